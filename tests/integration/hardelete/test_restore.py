"""``hardelete restore`` attacked on the real stack (Kafka, Redis, MinIO; the real tracker and
reaper): against a reaper's claim (live, then expired), in the reverse order (restore first,
then the reaper), twice (in turn and at once), and while the repository is paused or
fail-closed. Each keeps a copy of the object, and a refused restore touches nothing."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from core.errors import UserError
from core.settings import Settings
from hardelete.holds import add_hold
from reaper.daemon import Reaper
from reaper.quarantine import Restored, quarantine_address, restore
from schemas.layout import FAIL_CLOSED, AddressState, RepoKeys
from sim.model import Model
from sim.operations import claims, kept, make_garbage, reap_until, run, stored
from sim.testing import redis_now
from tracker.daemon import running_tracker
from tracker.state import parse_address


def _garbage(s: Settings, s3: Any, bucket: str, name: str) -> str:
    (g,) = asyncio.run(make_garbage(s, s3, Model.from_settings(s), "repo", [name],
                                    namespace=f"s3://{bucket}/repo/"))
    assert g is not None
    return g


def _state(redis_client: Any, g: str) -> str | None:
    return parse_address(redis_client.hgetall(RepoKeys("repo").address(g))).state


def _copy(g: str) -> str:
    bucket = g.removeprefix("s3://").split("/", 1)[0]
    return quarantine_address(f"s3://{bucket}/repo/", g)


def _quarantined(s: Settings, s3: Any, g: str) -> None:
    asyncio.run(reap_until(s, lambda rep: not stored(s3, g)))
    assert stored(s3, _copy(g))


def _past_grace(s: Settings, since_ms: int) -> Any:
    grace_ms = int(s.grace_seconds * 1000)
    return lambda rep: rep.horizon_ms is not None and rep.horizon_ms - grace_ms > since_ms + 500


def test_restore_under_a_reapers_claim_is_refused_until_it_is_settled_then_keeps_g(
        cli, capsys, s3, redis_client, bucket):
    """The reaper claims G and copies it to quarantine; legal holds G right then, so the
    recheck keeps it and the claim stays `reaping` until its lease runs out. restore is
    refused while the lease is live, and still after it ran out (the reaper's request may be
    in flight: only its next pass settles the claim), touching nothing. Once a pass has
    released the claim (G `unreferenced`, its quarantine copy left over), restore takes G;
    with the legal hold gone, restore's claim alone keeps G from the reaper (the reverse
    order: restore first, then the reaper's claim), until `hold remove --restore`."""
    s = cli.replace(quarantine_days=1.0, upload_ttl_seconds=1.0, lease_seconds=2.0)
    g = _garbage(s, s3, bucket, "g")
    q = _copy(g)
    gkey = g.removeprefix(f"s3://{bucket}/")

    async def claim_and_hold() -> None:
        async with running_tracker(s):
            reaper = Reaper(s)
            real = reaper.gate_s3.copy_object

            def copy_then_hold(**kw: Any) -> Any:
                out = real(**kw)
                if kw["CopySource"]["Key"] == gkey:  # claimed and copied: legal holds G now
                    add_hold(redis_client, g, "legal: case 21", s3=s3)
                return out

            reaper.gate_s3.copy_object = copy_then_hold
            try:
                deadline = time.monotonic() + 45
                while not redis_client.hexists(RepoKeys("repo").holds, g):
                    assert time.monotonic() < deadline
                    await reaper.run_once()
                    await asyncio.sleep(0.1)
            finally:
                await reaper.close()

    asyncio.run(claim_and_hold())
    assert stored(s3, g) and stored(s3, q) and _state(redis_client, g) == AddressState.REAPING

    code, _, err = run(capsys, "restore", "repo", g)
    assert code == 2 and "being deleted right now" in err and err.count("\n") == 1, err
    assert claims(redis_client, "repo", g) == {"operator"}  # nothing touched
    lease = int(redis_client.hget(RepoKeys("repo").address(g), "lease_until"))
    deadline = time.monotonic() + 30
    while asyncio.run(redis_now(s)) <= lease:  # the lease runs out on the Redis clock
        assert time.monotonic() < deadline
        time.sleep(0.1)
    code, _, err = run(capsys, "restore", "repo", g)
    assert code == 2 and "lease ran out" in err and "next reaper pass" in err, err
    assert claims(redis_client, "repo", g) == {"operator"} and stored(s3, q)

    # the next pass releases the claim (G is held): G is unreferenced, its copy left over
    asyncio.run(reap_until(s, lambda rep: kept(rep, "repo", "held") > 0))
    assert _state(redis_client, g) == AddressState.UNREFERENCED
    code, out, err = run(capsys, "restore", "repo", g)
    assert code == 0 and "restored" in out and "kept" not in out, err
    assert stored(s3, g) and not stored(s3, q)
    assert claims(redis_client, "repo", g) == {"operator", "restore"}

    # legal lets go: restore's claim alone keeps G from the reaper's claim, past its grace
    assert run(capsys, "hold", "remove", g)[0] == 0
    t0 = asyncio.run(redis_now(s))
    past, held = _past_grace(s, t0), []
    asyncio.run(reap_until(s, lambda rep: held.append(kept(rep, "repo", "held")) is None
                           and past(rep) and sum(held) > 0))
    assert stored(s3, g)
    assert _state(redis_client, g) == AddressState.UNREFERENCED
    # and restore's own release lets the reaper take it (into quarantine again)
    assert run(capsys, "hold", "remove", "--restore", g)[0] == 0
    _quarantined(s, s3, g)


def test_restore_twice_in_turn_and_at_once_keeps_g_held(cli, capsys, s3, redis_client, bucket):
    """A second restore finds no quarantine copy: one line, G stays in place and held. Two
    restores at once both end with G in place and held, whichever deletes the copy."""
    s = cli.replace(quarantine_days=1.0, upload_ttl_seconds=1.0, lease_seconds=2.0)
    g, h = _garbage(s, s3, bucket, "g"), _garbage(s, s3, bucket, "h")
    _quarantined(s, s3, g)
    _quarantined(s, s3, h)
    assert run(capsys, "restore", "repo", g)[0] == 0
    code, _, err = run(capsys, "restore", "repo", g)
    assert code == 2 and "not in quarantine: it is in place" in err and err.count("\n") == 1
    assert f"hardelete hold remove --restore {g}" in err
    assert stored(s3, g) and claims(redis_client, "repo", g) == {"restore"}

    async def both() -> list[Restored | BaseException]:
        return await asyncio.gather(restore(s, "repo", h), restore(s, "repo", h),
                                    return_exceptions=True)

    results = asyncio.run(both())
    assert any(isinstance(r, Restored) for r in results), results
    for r in results:
        assert isinstance(r, Restored) or (isinstance(r, UserError)
                                           and "it is in place" in str(r)), results
    assert stored(s3, h) and claims(redis_client, "repo", h) == {"restore"}
    assert _state(redis_client, h) == AddressState.UNREFERENCED


def test_restore_while_paused_or_fail_closed_keeps_the_quarantine_copy(cli, capsys, s3,
                                                                       redis_client, bucket):
    """A paused or fail-closed repository deletes nothing: restore brings G back and holds it,
    but keeps its quarantine copy (and says so); run again once resumed, it removes it."""
    s = cli.replace(quarantine_days=1.0, upload_ttl_seconds=1.0, lease_seconds=2.0)
    g, h = _garbage(s, s3, bucket, "g"), _garbage(s, s3, bucket, "h")
    _quarantined(s, s3, g)
    _quarantined(s, s3, h)
    assert run(capsys, "pause", "repo", "--reason", "audit")[0] == 0
    code, out, err = run(capsys, "restore", "repo", g)
    assert code == 0 and "is kept (paused" in out, (out, err)
    assert stored(s3, g) and stored(s3, _copy(g))
    assert claims(redis_client, "repo", g) == {"restore"}
    assert run(capsys, "resume", "repo")[0] == 0
    code, out, _ = run(capsys, "restore", "repo", g)
    assert code == 0 and "kept" not in out
    assert stored(s3, g) and not stored(s3, _copy(g))

    redis_client.hset(FAIL_CLOSED, mapping={"reason": "redis lost everything"})
    try:
        code, out, _ = run(capsys, "restore", "repo", h)
    finally:
        redis_client.delete(FAIL_CLOSED)
    assert code == 0 and "is kept (fail_closed" in out, out
    assert stored(s3, h) and stored(s3, _copy(h))


def test_restores_claim_survives_the_repositorys_redis_going_back(cli, capsys, s3, redis_client,
                                                                  bucket):
    """Restore's claim is a durable fact (core/facts.py; issue 34, finding 1): the slot taken
    back to a copy from before the restore (one node: restored from a backup; a cluster: its
    node failed over) loses the claim in Redis, and the next proof of any delete path puts it
    back. Before, the restored object was held only in Redis."""
    import redis as redis_lib

    from core.facts import RepoFacts
    from sim.testing import slot_copy, slot_go_back

    s = cli.replace(quarantine_days=1.0, upload_ttl_seconds=1.0, lease_seconds=2.0)
    g = _garbage(s, s3, bucket, "g")
    _quarantined(s, s3, g)
    raw = redis_lib.Redis.from_url(s.redis_url)
    try:
        before = slot_copy(raw, "repo")
        assert run(capsys, "restore", "repo", g)[0] == 0
        assert claims(redis_client, "repo", g) == {"restore"}
        slot_go_back(raw, "repo", before)
    finally:
        raw.close()
    assert claims(redis_client, "repo", g) == set() and stored(s3, g)
    proof = RepoFacts(redis_client, s3, "repo", f"s3://{bucket}/repo/").prove()
    assert proof.problem is None
    assert claims(redis_client, "repo", g) == {"restore"}
    # and lifting it is durable: a later go-back and proof do not bring it back
    assert run(capsys, "hold", "remove", "--restore", g)[0] == 0
    RepoFacts(redis_client, s3, "repo", f"s3://{bucket}/repo/").prove()
    assert claims(redis_client, "repo", g) == set()


def test_a_hold_on_an_address_already_reaped_is_refused_in_one_line(cli, capsys, s3,
                                                                    redis_client, bucket):
    """A hold that preserves nothing must not be accepted: `explain` would then say "kept
    (held)" while the bytes are gone (issue 36, item 4). One line that says why; nothing held.
    A quarantined address is held (the hold keeps its quarantine copy, the last one, from the
    purge), and so is one not written yet."""
    s = cli.replace(quarantine_days=0.0, upload_ttl_seconds=1.0, lease_seconds=2.0)
    g = _garbage(s, s3, bucket, "g")
    asyncio.run(reap_until(s, lambda rep: not stored(s3, g)))
    code, _, err = run(capsys, "hold", "add", g, "--reason", "legal: too late")
    assert code == 2 and err.count("\n") == 1, err
    assert "the reaper deleted it" in err and "nor in quarantine" in err
    assert claims(redis_client, "repo", g) == set()
    q = cli.replace(quarantine_days=1.0, upload_ttl_seconds=1.0, lease_seconds=2.0)
    h = _garbage(q, s3, bucket, "h")
    _quarantined(q, s3, h)
    assert run(capsys, "hold", "add", h, "--reason", "legal: keep the copy")[0] == 0
    assert claims(redis_client, "repo", h) == {"operator"}
    assert run(capsys, "hold", "add", f"s3://{bucket}/repo/data/later", "--reason", "x")[0] == 0
