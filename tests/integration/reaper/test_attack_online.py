"""Adversarial review of the online delete path (tracker, reaper, operator commands) on the real
stack (Kafka, Redis, MinIO). Each test drives a sequence of events, faults or operator commands
and asserts the SAFE outcome: the live object survives. A failing test is an open hole."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from core.errors import UserError
from core.settings import Settings
from reaper.daemon import Reaper
from schemas.events import BranchCreated, BranchDeleted, ObjectDeleted, ObjectWritten, encode
from schemas.layout import RepoKeys
from schemas.publisher import ensure_topics
from sim.model import Model
from sim.operations import (
    claims,
    created,
    make_garbage,
    publish_and_track,
    reap_until,
    run,
    stored,
    written,
)
from sim.reaping import _settings
from sim.testing import redis_now
from tracker.daemon import running_tracker
from tracker.state import parse_address

# The service certifies its history (schemas/README.md, "Continuity").
pytestmark = pytest.mark.usefixtures("sequenced")


def _put(s3: Any, address: str) -> None:
    bucket, _, key = address.removeprefix("s3://").partition("/")
    s3.put_object(Bucket=bucket, Key=key, Body=b"live")


def _past_grace(s: Settings, since_ms: int) -> Any:
    """A pass-report predicate: the tracker's proven progress is well past ``since + grace``."""
    grace_ms = int(s.grace_seconds * 1000)
    return lambda rep: rep.horizon_ms is not None and rep.horizon_ms - grace_ms > since_ms + 500


# --- 1. a removal that names another token than the reference's own ---

def test_a_removal_naming_another_token_does_not_end_a_live_reference(settings, s3, bucket):
    """Address A is staged in main's open token t1 by reference r1. An object_deleted for the
    same reference id arrives naming another token (dev's t2): a publisher that reuses a
    reference id across tokens (its shallow copy into dev) or a forged/misrouted event. The
    tracker records the removal keyed by the reference id only, so main's t1 entry counts as
    ended, A becomes unreferenced and the reaper deletes it while t1 (open) still references it
    (SPEC safety 1, 5, 6). The token the reference was added in is known: a removal that names
    another token is a contradiction, and doubt must keep."""
    s = _settings(settings)
    ns = f"s3://{bucket}/repo/"
    address = ns + "data/a"
    _put(s3, address)
    events = [created("repo", ns),
              written("repo", address, token="t1", ref="r1"),
              ObjectDeleted(repository="repo", branch="dev", staging_token="t2", path="p",
                            address=address, ref_id="r1")]
    asyncio.run(publish_and_track(s, *((encode(e), e.key) for e in events)))
    t0 = asyncio.run(redis_now(s))
    asyncio.run(reap_until(s, _past_grace(s, t0)))
    assert stored(s3, address), "reaped while open token t1 still references it"


def test_a_reused_reference_id_in_a_dropped_token_does_not_end_a_live_one(settings, s3,
                                                                          bucket):
    """The same reference id r1 is staged for A twice: first in dev's token, then in main's
    open token (a publisher reusing ids, or a shallow copy carrying its source's id). The
    tracker takes the second add for a duplicate ("a duplicate keeps the first token"), so r1
    is recorded in dev's token only; dev is deleted, its token dropped, and A is reaped while
    main's open token still references it (SPEC safety 1, 5: the same id with another token is
    not a duplicate)."""
    s = _settings(settings)
    ns = f"s3://{bucket}/repo/"
    address = ns + "data/b"
    _put(s3, address)
    events = [created("repo", ns),
              ObjectWritten(repository="repo", branch="dev", staging_token="t-dev", path="p",
                            address=address, size=3, ref_id="r1"),
              written("repo", address, token="t-main", ref="r1"),
              BranchDeleted(repository="repo", branch="dev", dropped_tokens=["t-dev"],
                            ref_version=2)]
    asyncio.run(publish_and_track(s, *((encode(e), e.key) for e in events)))
    t0 = asyncio.run(redis_now(s))
    asyncio.run(reap_until(s, _past_grace(s, t0)))
    assert stored(s3, address), "reaped while main's open token still references it"


def test_a_branch_delete_cannot_drop_another_branchs_open_token(settings, s3, bucket):
    """The mirror records main's open token t-main (branch_created). A branch_deleted of dev
    lists t-main among its dropped tokens (misrouted or forged: the tracker trusts the list).
    Every address staged only in main's open token becomes unreferenced and is reaped, though
    the mirror itself says t-main is main's open token (SPEC safety 1, 6)."""
    s = _settings(settings)
    ns = f"s3://{bucket}/repo/"
    address = ns + "data/c"
    _put(s3, address)
    events = [created("repo", ns),
              BranchCreated(repository="repo", branch="main", staging_token="t-main",
                            ref_version=1),
              BranchCreated(repository="repo", branch="dev", staging_token="t-dev",
                            ref_version=1),
              written("repo", address, token="t-main", ref="r1"),
              BranchDeleted(repository="repo", branch="dev", dropped_tokens=["t-main"],
                            ref_version=2)]
    asyncio.run(publish_and_track(s, *((encode(e), e.key) for e in events)))
    t0 = asyncio.run(redis_now(s))
    asyncio.run(reap_until(s, _past_grace(s, t0)))
    assert stored(s3, address), "reaped while it is staged in main's open token"


# --- 2. `hold remove` (restore's advice) also lifts a legal hold ---

def test_releasing_a_restored_object_keeps_a_legal_hold_on_it(cli, capsys, s3, redis_client,
                                                               bucket):
    """A quarantined address is restored (restore's claim), then legal puts it on hold
    (the operator's claim). The restore's message says `hardelete hold remove ADDRESS` lets the
    restored object go; that command removes the operator's claim as well (OPERATOR_CLAIMS =
    operator + restore), so the legal hold is lifted with it and the reaper deletes a held
    object. Two parties, one claim: each should be released by its own command (fixed:
    `hold remove` lifts the operator's claim only, `hold remove --restore` restore's, which is
    what restore advises)."""
    s = cli.replace(quarantine_days=1.0, upload_ttl_seconds=1.0, lease_seconds=2.0)
    model = Model.from_settings(s)
    (g,) = asyncio.run(make_garbage(s, s3, model, "repo", ["g"], namespace=f"s3://{bucket}/repo/"))
    assert g is not None
    asyncio.run(reap_until(s, lambda rep: not stored(s3, g)))
    code, out, _ = run(capsys, "restore", "repo", g)
    assert code == 0 and "hardelete hold remove" in out
    # the command restore advises, as the operator will paste it
    advice = out.split("`hardelete ", 1)[1].split("`", 1)[0].split()
    code, out, _ = run(capsys, "hold", "add", g, "--reason", "legal: case 12")
    assert code == 0
    assert claims(redis_client, "repo", g) == {"restore", "operator"}
    # The operator follows the restore's advice to let the restored copy go.
    code, out, _ = run(capsys, *advice)
    assert code == 0 and advice[:2] == ["hold", "remove"], advice
    t0 = asyncio.run(redis_now(s))
    asyncio.run(reap_until(s, _past_grace(s, t0)))
    assert stored(s3, g), f"a legally held object was reaped ({out.strip()})"
    assert "operator" in claims(redis_client, "repo", g), out


# --- 3. a restore racing the reaper's delete in flight ---

def test_a_restore_during_an_inflight_quarantine_keeps_a_copy(settings, s3, bucket,
                                                              redis_client):
    """quarantine_days > 0. The reaper claims G, copies it to quarantine and judges it right
    before its delete request. At that moment an operator runs `hardelete restore repo G`
    (e.g. from `quarantine list` of an earlier copy, or a retry): restore holds G, copies the
    quarantine copy back over G, deletes the quarantine copy, and (state `reaping`, not
    `reaped`) changes nothing in Redis. The reaper's request then deletes G. Both copies are
    gone, though restore reported success and G is held. restore must not delete the last
    copy while a claim on the address is in flight (fixed: restore's claim is placed in one
    script with the check that no reaper claims the address; here it is refused, nothing
    touched, and the quarantine copy is the one left)."""
    from reaper.quarantine import quarantine_address, restore

    s = _settings(settings, quarantine_days=1.0)
    ns = f"s3://{bucket}/repo/"
    model = Model.from_settings(s)
    (g,) = asyncio.run(make_garbage(s, s3, model, "repo", ["g"], namespace=ns))
    assert g is not None
    gkey = g.removeprefix(f"s3://{bucket}/")
    restored: list[str] = []

    async def go() -> None:
        async with running_tracker(s):
            reaper = Reaper(s)
            real = reaper.gate_s3.delete_objects

            def racing_delete(**kw: Any) -> Any:
                keys = [o["Key"] for o in kw["Delete"]["Objects"]]
                if gkey in keys and not restored:
                    # the recheck has passed; the operator's restore runs now
                    try:
                        restored.append(repr(asyncio.run(restore(s, "repo", g))))
                    except UserError as exc:  # refused: a reaper claims G
                        restored.append(f"refused: {exc}")
                return real(**kw)

            reaper.gate_s3.delete_objects = racing_delete
            try:
                t0 = await redis_now(s)
                grace_ms = int(s.grace_seconds * 1000)
                for _ in range(400):
                    rep = await reaper.run_once()
                    if restored or (rep.horizon_ms is not None
                                    and rep.horizon_ms - grace_ms > t0 + 10_000):
                        break
                    await asyncio.sleep(0.1)
            finally:
                await reaper.close()

    asyncio.run(ensure_topics(s))
    asyncio.run(go())
    assert restored, "the reaper never sent G's delete"
    q = quarantine_address(ns, g)
    assert stored(s3, g) or stored(s3, q), (
        f"restore said {restored[0]!r}, yet both G and its quarantine copy are gone")
    assert restored[0].startswith("refused: ") and "being deleted right now" in restored[0]
    assert stored(s3, q) and not stored(s3, g)  # the reaper's quarantine went through
    assert claims(redis_client, "repo", g) == set()  # the refused restore touched nothing


# --- 4. an operator's hold in a URL-encoded spelling ---

def test_a_hold_in_url_encoded_spelling_keeps_the_object_it_names(cli, capsys, s3, bucket,
                                                                   redis_client):
    """The operator pastes the address as a console shows it, '/' encoded as %2F. `hold add`
    accepts it ("held address ..."), stores the literal spelling, and the reaper, matching
    holds byte for byte against canonical addresses, deletes the object. schemas/address.py's
    rule is that a spelling with %XX escapes keeps every object it may mean (the tracker never
    records an address with escapes, so the decoded one is the only object it can mean)."""
    s = cli.replace(upload_ttl_seconds=1.0, lease_seconds=2.0)
    model = Model.from_settings(s)
    ns = f"s3://{bucket}/repo/"
    (g,) = asyncio.run(make_garbage(s, s3, model, "repo", ["g"], namespace=ns))
    assert g is not None
    asyncio.run(publish_and_track(s))
    encoded = ns + g.removeprefix(ns).replace("/", "%2F")
    code, out, err = run(capsys, "hold", "add", encoded, "--reason", "legal: case 13")
    assert code == 0 and "held address" in out, err
    rec = parse_address(redis_client.hgetall(RepoKeys("repo").address(g)))
    # past its upload's protection too (since and iu), so only the hold can keep it
    t0 = max(asyncio.run(redis_now(s)), rec.since or 0, rec.issued_until or 0)
    asyncio.run(reap_until(s, _past_grace(s, t0)))
    assert stored(s3, g), f"deleted though the operator was told: {out.strip()}"
