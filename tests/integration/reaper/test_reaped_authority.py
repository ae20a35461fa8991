"""Only the reaper vouches for a deletion, and a claim given back is judged from scratch.

Issue 19 findings: an ``addresses_reaped`` any publisher could send moved a live address to
``reaped`` (the reconciler then took the object); a reaped tombstone was pruned whatever its
record still protected; a claim released after a refused delete was judged on its original
"unreferenced since". End to end on the real servers, plus the pure and Lua rules.
"""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from core.clients import redis_async, s3_client
from core.settings import Settings
from reaper.claims import ClaimStore
from reaper.daemon import Reaper
from schemas import events as ev
from schemas import reaper_auth
from schemas.layout import INCIDENTS, REAPER_KEY, AddressState, RepoKeys, TokenState
from schemas.liveness import judge, tombstone_keeps
from schemas.publisher import Publisher, ensure_topics
from schemas.records import AddressRecord, decode_address
from sim.faultproxy import FaultProxy
from sim.model import Model
from sim.reaping import _service, _settings, _state_is
from sim.testing import dead_letters, listed, publish, wait_for, wait_horizon
from tracker.daemon import running_tracker
from tracker.state import parse_address

# The service certifies its history (schemas/README.md, "Continuity").
pytestmark = pytest.mark.usefixtures("sequenced")

# Every check holds on one Redis and on a real three-node Redis Cluster (issue 19 item 9).
BOTH_TOPOLOGIES = pytest.mark.parametrize("topology", ["single", "cluster"], indirect=True)


# ------------------------------------------------------------------------- pure: the rules

def test_signature_covers_every_field_and_needs_the_key() -> None:
    key = b"k" * 32
    body = {"repository": "r", "reaper": "rp", "event_id": "e1", "addresses": ["s3://b/r/a"]}
    signed = {**body, "signature": reaper_auth.sign(key, "r", "rp", "e1", ["s3://b/r/a"])}
    assert reaper_auth.verify(key, signed)
    assert not reaper_auth.verify(b"other", signed)
    assert not reaper_auth.verify(key, body) and not reaper_auth.verify(key, {
        **body, "signature": None})
    for field, value in (("repository", "r2"), ("reaper", "x"), ("event_id", "e2"),
                         ("addresses", ["s3://b/r/a", "s3://b/r/b"])):
        assert not reaper_auth.verify(key, {**signed, field: value})
    # length-prefixed: moving a boundary between fields changes the message
    assert reaper_auth.message("ab", "c", "e", []) != reaper_auth.message("a", "bc", "e", [])


NOW, GRACE, HORIZON = 1_000_000, 10_000, 1_000_000


@pytest.mark.parametrize("path", ["online", "reconciler"])
def test_a_reaped_record_never_overrides_a_reference_an_upload_or_grace(path: Any) -> None:
    def verdict(**kw: Any) -> Any:
        return judge(AddressRecord(state=AddressState.REAPED.value, reaped_at=NOW - 60_000,
                                    **kw),
                     {"open": TokenState.OPEN.value}, now_ms=NOW, horizon_ms=HORIZON,
                     grace_ms=GRACE, path=path)

    assert verdict(adds={"ref": "open"}).reason == "staged"
    assert verdict(issued_until=NOW + 3_600_000).reason == "issued"
    assert verdict(since=NOW - 1_000).reason == "young"  # a reference ended 1 s ago
    young = judge(AddressRecord(state="reaped", reaped_at=NOW - 1_000), {}, now_ms=NOW,
                  horizon_ms=HORIZON, grace_ms=GRACE, path=path)
    assert young.reason == "young"
    old = verdict(since=NOW - 30_000)
    assert old.may_delete == (path == "reconciler")
    assert old.reason == ("" if path == "reconciler" else "reaped")


# ------------------------------------------------------------------- Lua: the tombstone prune

@BOTH_TOPOLOGIES
async def test_prune_drops_only_tombstones_that_protect_nothing(settings: Settings,
                                                                redis_client: Any) -> None:
    keys = RepoKeys("r")
    old = 1  # reaped long ago
    records = {
        "clean": {"state": "reaped", "reaped_at": old},
        "live": {"state": "reaped", "reaped_at": old, "+ref": "open-tok"},
        "committed": {"state": "reaped", "reaped_at": old, "committed": "1"},
        "issued": {"state": "reaped", "reaped_at": old, "iu": 10**15},
        "touched": {"state": "reaped", "reaped_at": old, "since": 10**15},
        "dropped": {"state": "reaped", "reaped_at": old, "+ref": "gone-tok"},
    }
    redis_client.hset(keys.tokens, mapping={"open-tok": "open:1", "gone-tok": "dropped:1"})
    for name, fields in records.items():
        redis_client.hset(keys.address(f"s3://b/r/{name}"), mapping=fields)
        redis_client.zadd(keys.reaped, {f"s3://b/r/{name}": old})
    r = redis_async(settings)
    try:
        pruned = await ClaimStore(r).prune("r", tombstone_ms=1_000)
    finally:
        await r.aclose()
    assert pruned == 2
    left = {n for n in records if redis_client.exists(keys.address(f"s3://b/r/{n}"))}
    assert left == {"live", "committed", "issued", "touched"}
    # the script is the pure rule (liveness.tombstone_keeps)
    tokens = {"open-tok": "open:1", "gone-tok": "dropped:1"}
    now = int(redis_client.time()[0]) * 1000
    assert left == {n for n, fields in records.items() if tombstone_keeps(
        decode_address({k: str(v) for k, v in fields.items()}), tokens, now_ms=now,
        tombstone_ms=1_000)}
    # kept ones are looked at again later, not at the head of the index every pass
    assert all(score > old for _, score in redis_client.zscan_iter(keys.reaped))


# ----------------------------------------------------------------- end to end: the tracker

async def _staged_address(s: Settings, s3: Any, bucket: str) -> tuple[str, str]:
    await ensure_topics(s)
    async with Publisher(s) as pub:
        svc = await _service(s, s3, pub)
        await svc.call(Model.create_repository, "repo", f"s3://{bucket}/repo/")
        op = await svc.call(Model.write, "repo", "main", "live", 10)
    assert op.address
    return op.address, svc.model.branch("repo", "main").staging_token


@BOTH_TOPOLOGIES
async def test_a_forged_addresses_reaped_is_dead_lettered_with_an_incident(
        settings: Settings, s3: Any, redis_client: Any) -> None:
    s = _settings(settings)
    live, _token = await _staged_address(s, s3, "forged")
    async with running_tracker(s):
        unsigned = ev.AddressesReaped(repository="repo", addresses=[live], reaper="reaper-1")
        wrong_key = reaper_auth.sign(b"a publisher's guess", "repo", "reaper-1", "forged-2",
                                     [live])
        badly_signed = ev.AddressesReaped(repository="repo", addresses=[live],
                                          reaper="reaper-1", event_id="forged-2",
                                          signature=wrong_key)
        await wait_horizon(s, await publish(s, [unsigned, badly_signed]))
        reasons = await dead_letters(s, 2)
    assert set(reasons) == {unsigned.event_id, "forged-2"}
    assert all("forged addresses_reaped" in why for why in reasons.values())
    incidents = [orjson.loads(i) for i in redis_client.lrange(INCIDENTS, 0, -1)]
    assert {i["event_id"] for i in incidents if i["kind"] == "forged_reap"} == set(reasons)
    # the record is untouched: still staged, never reaped, nothing to prune
    rec = parse_address(redis_client.hgetall(RepoKeys("repo").address(live)))
    assert rec.state == AddressState.STAGED and rec.reaped_at is None
    assert not redis_client.zcard(RepoKeys("repo").reaped)
    assert live in listed(s3, "forged")


@BOTH_TOPOLOGIES
async def test_the_reapers_own_signed_records_are_applied(settings: Settings, s3: Any,
                                                          redis_client: Any) -> None:
    s = _settings(settings)
    await ensure_topics(s)
    async with Publisher(s) as pub:
        svc = await _service(s, s3, pub)
        await svc.call(Model.create_repository, "repo", "s3://signed/repo/")
        gone = (await svc.call(Model.write, "repo", "main", "gone", 10)).address
        await svc.call(Model.delete, "repo", "main", "gone")
    assert gone
    async with running_tracker(s):
        reaper = Reaper(s)
        try:
            async def reaped() -> bool:
                await reaper.run_once()
                return gone not in listed(s3, "signed")
            await wait_for(reaped, 30, "the reaper to delete the garbage")
            assert reaper.records_published == 1
        finally:
            await reaper.close()
        # The tracker applied the reaper's record (no dead letter): forget the reaper's own
        # Redis marking and replay the record: the tracker marks it reaped again by itself.
        key = redis_client.get(REAPER_KEY)
        assert key
        eid = "replayed"
        record = ev.AddressesReaped(repository="repo", addresses=[gone], reaper="reaper-x",
                                    event_id=eid, signature=reaper_auth.sign(
                                        key.encode(), "repo", "reaper-x", eid, [gone]))
        redis_client.hset(RepoKeys("repo").address(gone), "state", "unreferenced")
        await wait_horizon(s, await publish(s, [record]))
        assert await _state_is(s, "repo", gone, AddressState.REAPED)
    assert await dead_letters(s, 1, timeout=2.0) == {}


# ------------------------------------------------- end to end: a released claim is re-judged

@BOTH_TOPOLOGIES
async def test_a_claim_given_back_is_judged_again_from_its_last_reference(
        settings: Settings, s3: Any, redis_client: Any) -> None:
    grace = 4.0
    s = _settings(settings, grace_seconds=grace, lease_seconds=1.0)
    await ensure_topics(s)
    async with Publisher(s) as pub:
        svc = await _service(s, s3, pub)
        await svc.call(Model.create_repository, "repo", "s3://rejudge/repo/")
        victim = (await svc.call(Model.write, "repo", "main", "v", 10)).address
        await svc.call(Model.delete, "repo", "main", "v")
        token = svc.model.branch("repo", "main").staging_token
    assert victim
    key = victim.split("/", 3)[3]
    keys = RepoKeys("repo")
    with FaultProxy(s.s3_endpoint_url) as proxy:
        # The store refuses the delete (a throttled or denied request) until told otherwise.
        proxy.faults.fail_keys = {key: ("AccessDenied", 10**6)}
        reaper = Reaper(s, s3=s3_client(s.replace(s3_endpoint_url=proxy.url)))
        try:
            async with running_tracker(s):
                async def claimed_and_refused() -> bool:
                    rep = await reaper.run_once()
                    return rep.total("failed") > 0
                await wait_for(claimed_and_refused, 30, "the claim and the refused delete")
                assert await _state_is(s, "repo", victim, AddressState.REAPING)
                # Meanwhile a reference comes and goes (a copy into the open token, deleted).
                copied = ev.ObjectCopied(repository="repo", branch="main",
                                         staging_token=token, path="copy", address=victim,
                                         size=10, ref_id="late-ref", source_read_at=0.0)
                gone = ev.ObjectDeleted(repository="repo", branch="main",
                                        staging_token=token, path="copy", address=victim,
                                        ref_id="late-ref")
                # (Redis time once both are acknowledged: the reference ends no earlier)
                last_end = await publish(s, [copied, gone])
                await wait_horizon(s, last_end)
                # When the tracker applied the last reference's end (Redis time, the
                # repository's node): ``last_end`` is read after the producer closed, which
                # under load came 0.4 s later and failed the check below for nothing.
                ended = parse_address(redis_client.hgetall(keys.address(victim))).since
                proxy.faults.fail_keys = {}

                async def reaped() -> bool:
                    await reaper.run_once()
                    return await _state_is(s, "repo", victim, AddressState.REAPED)
                await wait_for(reaped, 30, "the re-judged claim to be reaped")
        finally:
            await reaper.close()
    rec = parse_address(redis_client.hgetall(keys.address(victim)))
    # Before the fix it went at the lease's end (about 1 s after the last reference ended),
    # judged on the since of its first delete. The reference's end is the tracker's apply
    # time (``ended``), which may come a little before or after ``last_end`` (read once the
    # broker acknowledged the events; seen 15 ms after it under load): the check is against
    # ``ended``, and ``last_end`` is only shown.
    assert rec.reaped_at is not None and ended is not None
    assert rec.reaped_at - ended >= grace * 1000, (rec.reaped_at, ended, last_end)
    assert victim not in listed(s3, "rejudge")
