"""Rebuild of a fail-closed repository from the service's whole-state export (issue 20, item 1).

Real stack: MinIO (objects, manifests, the export), Redis with the tracker's apply script. The
events lost in the gap are model events never applied (what a lost broker log leaves); the flag
is the one the tracker writes (reason and loss counter).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

import orjson
import pytest

import tracker.rebuild as rb
from schemas.layout import RepoKeys
from sim.model import Model as M
from sim.rebuilding import (
    MAX_AGE,
    call,
    export,
    fail_over_to,
    lose_log,
    past_upload_windows,
    reapable,
    state_of,
)
from sim.testing import slot_copy
from sim.worlds import BUCKET, World, make_world
from tracker.rebuild import RebuildError, heal, prepare, read_export, rebuild, write_export
from tracker.state import read_repo_state


@pytest.fixture
def w(settings, s3, redis_client) -> World:
    world = make_world(settings, s3, redis_client)
    world.model.upload_ttl_seconds = 1.0  # upload protection is not what is tested here
    return world


def scenario(w: World) -> dict[str, Any]:
    """Applied: a, b committed in c1; s staged on main; g and k staged on side. Lost with the
    log: g deleted (side's token stays open), x written and committed with s (c2), branch feat
    with y staged, tag t at c1."""
    call(w, M.create_repository, "r", f"s3://{BUCKET}/rebuild/r/")
    a = call(w, M.write, "r", "main", "a", 10).address
    b = call(w, M.write, "r", "main", "b", 10).address
    c1 = call(w, M.commit, "r", "main").commit.id
    s = call(w, M.write, "r", "main", "s", 10).address
    call(w, M.create_branch, "r", "side", c1)
    g = call(w, M.write, "r", "side", "g", 10).address
    k = call(w, M.write, "r", "side", "k", 10).address
    w.track(None)
    call(w, M.delete, "r", "side", "g")
    x = call(w, M.write, "r", "main", "x", 10).address
    c2 = call(w, M.commit, "r", "main").commit.id
    call(w, M.create_branch, "r", "feat", c2)
    y = call(w, M.write, "r", "feat", "y", 10).address
    call(w, M.create_tag, "r", "t", c1)
    w.applied = len(w.model.events)  # lost: never applied
    lose_log(w, "r")
    past_upload_windows(w, "r")
    return {"a": a, "b": b, "c1": c1, "c2": c2, "s": s, "g": g, "k": k, "x": x, "y": y}


def test_a_rebuild_removes_only_what_the_service_removed_and_lifts_the_flag(w: World) -> None:
    h = scenario(w)
    assert state_of(w, "r", h["g"]) == "staged"  # its delete was lost
    assert state_of(w, "r", h["x"]) == "none"  # its write and commit were lost
    p = prepare(w.r, w.s3, "r")
    # after the snapshot, before the export: applied, and in the export
    z = call(w, M.write, "r", "main", "z", 10).address
    w.track(None)
    location = export(w, "r", p.nonce)
    # after the export: applied, not in the export, not in the snapshot: never removed
    q = call(w, M.write, "r", "main", "q", 10).address
    w.track(None)
    report = rebuild(w.r, w.s3, "r", location, max_age_ms=MAX_AGE, by="test")

    assert not w.r.exists(RepoKeys("r").fail_closed)
    assert not w.r.exists(RepoKeys("r").rebuild), "the prepared rebuild is consumed"
    incidents = [orjson.loads(i) for i in w.r.lrange(RepoKeys("r").incidents, 0, -1)]
    rebuilt = [i for i in incidents if i["type"] == "rebuilt"]
    assert len(rebuilt) == 1 and rebuilt[0]["refs_removed"] == 1, rebuilt
    assert report.counts["refs_removed"] == 1 and report.counts["commits_added"] == 1
    assert report.counts["tokens_dropped"] == 1  # main's token, committed by the lost c2

    # g: its removal was lost; proven removed, its grace starts now
    assert state_of(w, "r", h["g"]) == "unreferenced"
    assert reapable(w, "r", h["g"])
    since = read_repo_state(w.r, "r").addresses[h["g"]].since
    assert since is not None and since >= p.at_ms
    # x and s: in a commit the mirror never saw: committed from its manifest (their token
    # is dropped, not known committed), never reaped online
    for name in ("a", "b", "s", "x"):
        assert state_of(w, "r", h[name]) == "committed", name
        assert not reapable(w, "r", h[name])
    # y: staged on a branch whose creation was lost: a live reference now
    assert state_of(w, "r", h["y"]) == "staged"
    for address in (h["k"], h["y"], z, q):
        assert state_of(w, "r", address) == "staged", address
        assert not reapable(w, "r", address)
    st = read_repo_state(w.r, "r")
    assert st.tags.get("t") == h["c1"]
    assert h["c2"] in st.commits
    assert "feat" in st.branches and st.branches["main"].head == h["c2"]
    # the garbage the model calls online garbage is exactly what is reapable now
    truth = w.model.truth(issued_ttl_respected=False)
    for address in (h["a"], h["b"], h["s"], h["k"], h["x"], h["y"], z, q):
        assert address not in truth.online_garbage
    assert h["g"] in truth.online_garbage


def test_events_after_the_rebuild_apply_on_top(w: World) -> None:
    h = scenario(w)
    p = prepare(w.r, w.s3, "r")
    location = export(w, "r", p.nonce)
    rebuild(w.r, w.s3, "r", location, max_age_ms=MAX_AGE)
    # the export gives back what is left of y's upload ticket, linked or not (by the model's
    # clock, which barely moves): y ends 'unreferenced', not 'issued', once it has passed
    past_upload_windows(w, "r")
    call(w, M.delete, "r", "feat", "y")
    call(w, M.delete_tag, "r", "t")
    w.track(None)
    assert state_of(w, "r", h["y"]) == "unreferenced"
    assert "t" not in read_repo_state(w.r, "r").tags


def test_a_late_reference_to_a_token_the_service_ended_is_not_live_for_ever(w: World) -> None:
    """Seed 103's 19 kept objects: a write and its token's creation and commit were lost with
    the log; the write's event came late, after the rebuild. The token was unknown to the
    mirror, and an unknown token counts as live: kept by the reaper and every mark, for ever.
    The export now lists the tokens the service ended: the token is dropped in the mirror,
    and its address is judged as the manifest says (committed: retention decides)."""
    from reconciler.records import verdict
    from schemas import events as ev

    call(w, M.create_repository, "r", f"s3://{BUCKET}/rebuild5/r/")
    w.track(None)
    call(w, M.write, "r", "main", "a", 10)
    call(w, M.commit, "r", "main")  # main's next token: its creation is lost below
    late = call(w, M.write, "r", "main", "late", 10)
    write = next(e for e in late if isinstance(e, ev.ObjectWritten))
    call(w, M.commit, "r", "main")
    w.applied = len(w.model.events)  # lost: both commits (the token's creation and end), writes
    lose_log(w, "r")
    past_upload_windows(w, "r")
    p = prepare(w.r, w.s3, "r")
    rebuild(w.r, w.s3, "r", export(w, "r", p.nonce), max_age_ms=MAX_AGE)
    w.model.events.append(write)  # delivered late, after the rebuild
    w.track(None)
    st = read_repo_state(w.r, "r")
    assert st.token_state(write.staging_token) is not None  # dropped, not unknown
    assert state_of(w, "r", late.address) != "staged"
    assert not reapable(w, "r", late.address)  # committed in c1: never the online path's
    sec, _ = w.r.time()
    v = verdict(w.r.hgetall(RepoKeys("r").address(late.address)),
                token_states={t: s.value for t, (s, _) in st.tokens.items()},
                cutoff_ms=sec * 1000, now_ms=sec * 1000)
    assert not v.live and v.kind == "committed", v  # the mark: retention decides


def test_a_deleted_branch_is_not_brought_back_by_an_older_event_delivered_after_the_rebuild(
        w: World) -> None:
    """Seed 103's 8 kept objects: a commit on a branch was dead-lettered, the branch's deletion
    was lost with the log, the rebuild removed the branch, and the dead letter, replayed once
    resolved, brought it back (its version was above the snapshot's) with a head commit that
    kept its objects for ever. The export gives the version of each deletion: the rebuild
    records it as the delete event would, and the older event is stale."""
    from schemas import events as ev

    call(w, M.create_repository, "r", f"s3://{BUCKET}/rebuild6/r/")
    call(w, M.create_branch, "r", "dev", None)
    call(w, M.write, "r", "dev", "d", 10)
    w.track(None)
    late = next(e for e in call(w, M.commit, "r", "dev") if isinstance(e, ev.CommitCreated))
    call(w, M.delete_branch, "r", "dev")
    w.applied = len(w.model.events)  # lost: the commit (dead-lettered) and the deletion
    lose_log(w, "r")
    past_upload_windows(w, "r")
    p = prepare(w.r, w.s3, "r")
    report = rebuild(w.r, w.s3, "r", export(w, "r", p.nonce), max_age_ms=MAX_AGE)
    assert report.counts["refs_deleted"] == 1 and report.counts["tombstones"] == 1
    assert "dev" not in read_repo_state(w.r, "r").branches
    w.model.events.append(late)  # the dead letter, replayed after the rebuild
    w.track(None)
    st = read_repo_state(w.r, "r")
    assert "dev" not in st.branches, st.branches
    assert late.commit_id in st.commits  # the commit itself is still recorded


def test_a_snapshot_token_the_export_no_longer_lists_is_dropped(w: World) -> None:
    """A reset lost with the log: the old token's references end at the rebuild."""
    call(w, M.create_repository, "r", f"s3://{BUCKET}/rebuild2/r/")
    call(w, M.create_branch, "r", "dev", None)
    d = call(w, M.write, "r", "dev", "d", 10).address
    w.track(None)
    call(w, M.reset_branch, "r", "dev")
    w.applied = len(w.model.events)
    lose_log(w, "r")
    past_upload_windows(w, "r")  # d ends 'unreferenced', not 'issued'
    p = prepare(w.r, w.s3, "r")
    report = rebuild(w.r, w.s3, "r", export(w, "r", p.nonce), max_age_ms=MAX_AGE)
    assert report.counts["tokens_dropped"] == 1
    assert state_of(w, "r", d) == "unreferenced"


# --- what refuses (nothing lifted, nothing changed) --------------------------------------------


def refused(w: World, location: str, says: str, max_age_ms: int = MAX_AGE) -> None:
    before = read_repo_state(w.r, "r").addresses
    with pytest.raises(RebuildError, match=says):
        rebuild(w.r, w.s3, "r", location, max_age_ms=max_age_ms)
    assert w.r.exists(RepoKeys("r").fail_closed)
    assert read_repo_state(w.r, "r").addresses == before


def test_an_export_taken_before_the_prepare_is_refused(w: World) -> None:
    scenario(w)
    old = prepare(w.r, w.s3, "r")
    location = export(w, "r", old.nonce)
    prepare(w.r, w.s3, "r")  # a newer snapshot: the export does not prove it
    refused(w, location, "not the prepared one")


def test_a_loss_after_the_prepare_makes_it_stale(w: World) -> None:
    scenario(w)
    p = prepare(w.r, w.s3, "r")
    location = export(w, "r", p.nonce)
    lose_log(w, "r")
    refused(w, location, "lost again")


def test_bad_named_evidence_refuses_the_rebuild_with_one_line(w: World, tmp_path) -> None:
    scenario(w)
    p = prepare(w.r, w.s3, "r")
    good = read_export(w.s3, export(w, "r", p.nonce), f"s3://{BUCKET}/rebuild/r/", "r")
    refused(w, str(tmp_path / "missing"), "cannot read")
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "state.json").write_text("{not json")
    refused(w, str(tmp_path / "junk"), "not JSON")
    (tmp_path / "v1").mkdir()
    (tmp_path / "v1" / "state.json").write_bytes(orjson.dumps({"format": 1}))
    refused(w, str(tmp_path / "v1"), "not a format-2")
    other = orjson.loads(good.to_json())
    other["repository"] = "someone-else"
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "state.json").write_bytes(orjson.dumps(other))
    refused(w, str(tmp_path / "other"), "is for repository 'someone-else'")
    outside = orjson.loads(good.to_json())
    next(iter(outside["tokens"].values()))["entries"].append(
        {"address": "s3://elsewhere/k", "ref_id": "r1", "size": 1})
    (tmp_path / "outside").mkdir()
    (tmp_path / "outside" / "state.json").write_bytes(orjson.dumps(outside))
    refused(w, str(tmp_path / "outside"), "outside namespace")
    shapeless = orjson.loads(good.to_json())
    del shapeless["commits"]
    (tmp_path / "shape").mkdir()
    (tmp_path / "shape" / "state.json").write_bytes(orjson.dumps(shapeless))
    refused(w, str(tmp_path / "shape"), "malformed")
    write_export(w.s3, str(tmp_path / "good"), good)
    refused(w, str(tmp_path / "good"), "older than", max_age_ms=1)
    # and the good one, named right, rebuilds
    rebuild(w.r, w.s3, "r", str(tmp_path / "good"), max_age_ms=MAX_AGE)
    assert not w.r.exists(RepoKeys("r").fail_closed)


def test_a_commit_whose_manifest_cannot_be_read_keeps_the_flag(w: World) -> None:
    h = scenario(w)
    p = prepare(w.r, w.s3, "r")
    location = export(w, "r", p.nonce)
    manifest = w.model.commits[h["c2"]].manifest
    bucket, _, key = manifest[5:].partition("/")
    w.s3.delete_object(Bucket=bucket, Key=key)
    refused(w, location, "cannot be read")


def test_a_repository_that_is_not_fail_closed_has_nothing_to_rebuild(w: World) -> None:
    call(w, M.create_repository, "r", f"s3://{BUCKET}/rebuild3/r/")
    w.track(None)
    with pytest.raises(RebuildError, match="neither fail-closed nor broken"):
        prepare(w.r, w.s3, "r")


def test_no_event_carries_the_rebuild_op(w: World) -> None:
    """Op 13 is refused on a partition (an event's path), whatever it says."""
    from tracker.state import ApplyScript

    call(w, M.create_repository, "r", f"s3://{BUCKET}/rebuild4/r/")
    w.track(None)
    lose_log(w, "r")
    with pytest.raises(Exception, match="unknown op"):
        ApplyScript.apply_sync(w.r, "r", 0, [[10_000, 13, "lift", "{}"]])
    assert w.r.exists(RepoKeys("r").fail_closed)


def test_the_script_refuses_a_plan_whose_snapshot_is_no_longer_the_prepared_one(w: World) -> None:
    """The guard in apply.lua (a prepare or a loss between the checks in Python and a chunk)."""
    from tracker.rebuild import _apply

    scenario(w)
    p = prepare(w.r, w.s3, "r")
    lift = [13, "lift", orjson.dumps({"type": "rebuilt"}).decode()]
    for nonce, losses in (("another", p.losses), (p.nonce, "7")):
        with pytest.raises(RebuildError, match="stale"):
            _apply(w.r, "r", [[0, 13, "guard", nonce, losses], [1, *lift]])
        assert w.r.exists(RepoKeys("r").fail_closed)
    _apply(w.r, "r", [[0, 13, "guard", p.nonce, p.losses], [1, *lift]])
    assert not w.r.exists(RepoKeys("r").fail_closed)


def test_the_trackers_round_prepares_then_applies_the_export_the_service_wrote(w: World) -> None:
    """Self-healing (tracker/rebuild.py heal, the tracker's loop): nothing but the service's
    export under the namespace's _hardelete/exports/ is needed."""
    from tracker.rebuild import heal

    h = scenario(w)
    first = heal(w.r, w.s3, max_age_ms=MAX_AGE, by="test")
    assert first.prepared == ["r"] and not first.rebuilt, first
    nonce = w.r.hget(RepoKeys("r").rebuild, "nonce")
    assert heal(w.r, w.s3, max_age_ms=MAX_AGE, by="test").rebuilt == []  # no export yet
    export(w, "r", "some-other-nonce")  # an export of another prepare is not taken
    assert heal(w.r, w.s3, max_age_ms=MAX_AGE, by="test").rebuilt == []
    export(w, "r", nonce)
    done = heal(w.r, w.s3, max_age_ms=MAX_AGE, by="test")
    assert [rep.repository for rep in done.rebuilt] == ["r"], done
    assert not w.r.exists(RepoKeys("r").fail_closed)
    assert state_of(w, "r", h["g"]) == "unreferenced"
    assert state_of(w, "r", h["x"]) == "committed"
    # and a loss after a prepare makes the next round prepare again
    lose_log(w, "r")
    again = heal(w.r, w.s3, max_age_ms=MAX_AGE, by="test")
    assert again.prepared == ["r"]
    assert w.r.hget(RepoKeys("r").rebuild, "nonce") != nonce


async def _export_heal_and_reap(s: Any, s3: Any, r: Any, ns: str, deadline: float) -> None:
    """The service's part once the tracker prepared a rebuild of repo0 (keep and new staged,
    gone deleted), then, once the flag lifted and gone's grace passed, one reaper pass. (A
    fresh issued address makes the horizon move past the grace.)"""
    from core.guards import fail_closed_reason
    from reaper.daemon import Reaper
    from schemas import events as ev
    from schemas.records import BranchRecord
    from sim.testing import publish, redis_now, wait_horizon
    from tracker.rebuild import ExportEntry, StateExport

    nonce = r.hget(RepoKeys("repo0").rebuild, "nonce")
    export = StateExport(
        "repo0", await redis_now(s), nonce, {"main": (BranchRecord(None, "t1"), 1)}, {},
        {"t1": ("open", (ExportEntry(ns + "data/keep", "k1", 1),
                         ExportEntry(ns + "data/new", "n1", 1)))}, {}, {})
    write_export(s3, f"{ns}_hardelete/exports/state-1/", export)
    while fail_closed_reason(r, "repo0") is not None:
        assert time.monotonic() < deadline + 30, "the tracker did not rebuild"
        await asyncio.sleep(0.1)
    since = int(r.zscore(RepoKeys("repo0").unreferenced, ns + "data/gone"))
    await wait_horizon(s, since + int(s.grace_for("repo0") * 1000) + 500)
    await publish(s, [ev.AddressIssued(repository="repo0", address=ns + "data/i0",
                                       ttl_seconds=60.0)])
    reaper = Reaper(s)
    try:
        await reaper.run_once()
    finally:
        await reaper.close()


async def test_a_lost_broker_log_heals_by_itself_and_only_the_removed_object_goes(
        settings, s3, bucket, tmp_path) -> None:
    """End to end on Apache Kafka, Redis, MinIO: the tracker is stopped, a delete is published
    and the broker's log is lost before it is applied; the restarted tracker fails the
    repository closed and prepares a rebuild by itself; the service (here the test) exports
    its state with the nonce; the tracker applies it, the flag lifts, and the reaper takes the
    object whose delete was lost, and nothing else."""
    from core.clients import redis_sync
    from core.guards import fail_closed_reason
    from sim.log_loss import _lose_log, delete, repo_events, write
    from sim.stack import kafka_server
    from sim.testing import publish, wait_horizon
    from tracker.daemon import running_tracker

    server = kafka_server(tmp_path)
    await asyncio.to_thread(server.start)
    try:
        s = settings.replace(kafka_bootstrap=f"127.0.0.1:{server.port}", topic_partitions=1,
                             rebuild_interval_seconds=0.3)
        ns = f"s3://{bucket}/repo0/"
        for key in ("keep", "gone", "new"):
            s3.put_object(Bucket=bucket, Key=f"repo0/data/{key}", Body=b"x")
        async with running_tracker(s):
            await wait_horizon(s, await publish(s, [*repo_events(ns),
                                                    write("repo0", ns + "data/keep", "k1"),
                                                    write("repo0", ns + "data/gone", "g1")]))
        await publish(s, [delete("repo0", ns + "data/gone", "g1")])  # never applied ...
        await asyncio.to_thread(_lose_log, server)  # ... lost with the log
        r = redis_sync(s)
        async with running_tracker(s, name="after-loss"):
            await wait_horizon(s, await publish(s, [write("repo0", ns + "data/new", "n1")]),
                               timeout=90)
            assert fail_closed_reason(r, "repo0") is not None
            deadline = time.monotonic() + 30
            while not r.hget(RepoKeys("repo0").rebuild, "nonce"):
                assert time.monotonic() < deadline, "the tracker prepared no rebuild"
                await asyncio.sleep(0.1)
            await _export_heal_and_reap(s, s3, r, ns, deadline)
        left = {o["Key"] for o in s3.list_objects_v2(Bucket=bucket,
                                                     Prefix="repo0/data/")["Contents"]}
        assert left == {"repo0/data/keep", "repo0/data/new"}
        incidents = [orjson.loads(i) for i in r.lrange(RepoKeys("repo0").incidents, 0, -1)]
        assert [i["by"] for i in incidents if i["type"] == "rebuilt"] == ["tracker after-loss"]
        r.close()
    finally:
        await asyncio.to_thread(server.stop)


def test_a_cluster_nodes_regressed_marker_goes_with_the_flag(w: World) -> None:
    from schemas.layout import APPLIED

    scenario(w)
    w.r.hset(APPLIED, "r", orjson.dumps({"regressed": "a node went back"}).decode())
    w.r.hset(APPLIED, "other", orjson.dumps({"0": "e:5"}).decode())
    p = prepare(w.r, w.s3, "r")
    rebuild(w.r, w.s3, "r", export(w, "r", p.nonce), max_age_ms=MAX_AGE)
    assert not w.r.hexists(APPLIED, "r")
    assert w.r.hexists(APPLIED, "other")


class Crash(Exception):
    pass


def _gap_commit(w: World, ns: str) -> dict[str, Any]:
    """s staged on main and applied; then main committed (c2) with the commit event lost."""
    call(w, M.create_repository, "r", f"s3://{BUCKET}/{ns}/r/")
    s = call(w, M.write, "r", "main", "s", 10).address
    w.track(None)
    c2 = call(w, M.commit, "r", "main").commit.id
    w.applied = len(w.model.events)  # lost
    lose_log(w, "r")
    return {"s": s, "c2": c2}


def test_a_rebuild_that_stops_between_chunks_and_is_retried_keeps_a_lost_commits_data(
        w: World, monkeypatch: pytest.MonkeyPatch) -> None:
    """Found by an adversarial review: a chunk wrote the lost commit's record, the process died
    before the chunk with its manifest's marks; the retry (same prepare, same export) counted
    the commit as known, marked nothing, and dropped its token (absent from the export): s,
    in retained commit c2, became unreferenced and reapable."""
    h = _gap_commit(w, "atk1")
    p = prepare(w.r, w.s3, "r")
    location = export(w, "r", p.nonce)
    real = rb._apply
    monkeypatch.setattr(rb, "CHUNK", 1)

    def crashing(r: Any, repo: str, compact: list[list[Any]]) -> Any:
        out = real(r, repo, compact)
        if any(e[1] == 13 and e[2] == "commit" for e in compact):
            raise Crash("rebuild process killed after the commit chunk")
        return out

    monkeypatch.setattr(rb, "_apply", crashing)
    with pytest.raises(Crash):
        rebuild(w.r, w.s3, "r", location, max_age_ms=MAX_AGE)
    assert w.r.exists(RepoKeys("r").fail_closed)
    monkeypatch.setattr(rb, "_apply", real)
    monkeypatch.setattr(rb, "CHUNK", 2000)
    rebuild(w.r, w.s3, "r", location, max_age_ms=MAX_AGE)  # the operator retries
    assert not w.r.exists(RepoKeys("r").fail_closed)
    assert state_of(w, "r", h["s"]) == "committed"
    assert not reapable(w, "r", h["s"])


def test_a_loss_between_chunks_then_a_new_prepare_keeps_a_lost_commits_data(
        w: World, monkeypatch: pytest.MonkeyPatch) -> None:
    """Same, through the documented path: a new loss makes chunk k+1 stale; the operator
    prepares again and exports again."""
    h = _gap_commit(w, "atk1b")
    p = prepare(w.r, w.s3, "r")
    location = export(w, "r", p.nonce)
    real = rb._apply
    monkeypatch.setattr(rb, "CHUNK", 1)

    def losing(r: Any, repo: str, compact: list[list[Any]]) -> Any:
        out = real(r, repo, compact)
        if any(e[1] == 13 and e[2] == "commit" for e in compact):
            lose_log(w, "r")
        return out

    monkeypatch.setattr(rb, "_apply", losing)
    with pytest.raises(rb.RebuildError, match="stale"):
        rebuild(w.r, w.s3, "r", location, max_age_ms=MAX_AGE)
    monkeypatch.setattr(rb, "_apply", real)
    monkeypatch.setattr(rb, "CHUNK", 2000)
    p2 = prepare(w.r, w.s3, "r")
    rebuild(w.r, w.s3, "r", export(w, "r", p2.nonce), max_age_ms=MAX_AGE)
    assert state_of(w, "r", h["s"]) == "committed"
    assert not reapable(w, "r", h["s"])


def test_a_retired_repository_is_not_rebuilt(w: World) -> None:
    scenario(w)
    p = prepare(w.r, w.s3, "r")
    location = export(w, "r", p.nonce)
    w.r.hset(RepoKeys("r").meta, "retired_at", "1")
    refused(w, location, "retired")




def test_a_resurrected_old_prepare_is_not_healed_with_its_old_export(w: World) -> None:
    """Found by an adversarial review: a Redis Cluster node failing over to a lagging replica
    (only the repository's slot goes back) brought back an older prepare, whose export,
    still in _hardelete/exports/, lifted the flag over a later loss it predates."""
    call(w, M.create_repository, "r", f"s3://{BUCKET}/atk6/r/")
    s = call(w, M.write, "r", "main", "s", 10).address
    w.track(None)
    lose_log(w, "r")                                       # loss 1 (losses=1)
    first = heal(w.r, w.s3, max_age_ms=MAX_AGE, by="A")    # the tracker prepares P1
    assert first.prepared == ["r"]
    n1 = w.r.hget(RepoKeys("r").rebuild, "nonce")
    export(w, "r", n1)                                     # the service exports E1 (nonce N1)
    replica = slot_copy(w.r, "r")                         # the replica is this far behind

    # Before the next heal round: the log is lost again, with main's commit c5 (x, s) in it.
    x = call(w, M.write, "r", "main", "x", 10).address
    c5 = call(w, M.commit, "r", "main").commit.id
    w.applied = len(w.model.events)                        # lost: never applied
    lose_log(w, "r")                                       # loss 2 (losses=2)
    again = heal(w.r, w.s3, max_age_ms=MAX_AGE, by="A")    # P2 (N2): E1 is stale, rightly
    assert again.prepared == ["r"]

    fail_over_to(w.r, "r", replica)                       # the slot goes back: losses=1, N1
    healed = heal(w.r, w.s3, max_age_ms=MAX_AGE, by="B")   # next round of any tracker

    st = read_repo_state(w.r, "r")
    lifted = not w.r.exists(RepoKeys("r").fail_closed)
    # The safe outcomes: still fail-closed, or a mirror that knows c5 (main's head, retained).
    assert not lifted or c5 in st.commits, (
        f"flag lifted by {healed.rebuilt} with E1 (taken before loss 2): the mirror misses "
        f"retained commit {c5} (main's head {st.branches['main'].head}), x is "
        f"{state_of(w, 'r', x)!r}, s is {state_of(w, 'r', s)!r}: the reconciler takes x")


def test_a_lift_lost_with_a_failover_is_not_redone_with_the_old_export(w: World) -> None:
    """Same, the other order: E1 was applied (lift), the repository lived on (c5 committed,
    applied), then the slot failed over to a replica from before the lift."""
    call(w, M.create_repository, "r", f"s3://{BUCKET}/atk6b/r/")
    call(w, M.write, "r", "main", "s", 10)
    w.track(None)
    lose_log(w, "r")
    heal(w.r, w.s3, max_age_ms=MAX_AGE, by="A")
    export(w, "r", w.r.hget(RepoKeys("r").rebuild, "nonce"))
    replica = slot_copy(w.r, "r")
    done = heal(w.r, w.s3, max_age_ms=MAX_AGE, by="A")
    assert done.rebuilt and not w.r.exists(RepoKeys("r").fail_closed)
    x = call(w, M.write, "r", "main", "x", 10).address
    c5 = call(w, M.commit, "r", "main").commit.id
    w.track(None)                                          # applied on the old primary
    assert state_of(w, "r", x) == "committed"
    fail_over_to(w.r, "r", replica)                       # ... lost with its node
    heal(w.r, w.s3, max_age_ms=MAX_AGE, by="B")
    st = read_repo_state(w.r, "r")
    lifted = not w.r.exists(RepoKeys("r").fail_closed)
    assert not lifted or c5 in st.commits, (
        f"flag lifted again with the old export: mirror misses retained commit {c5}; x is "
        f"{state_of(w, 'r', x)!r}")

# A write lost with the broker log, committed by a commit the mirror did apply (from the new
# log, before the prepare). Found by the soak as dead-letter operator (seed 103): the rebuild
# marked only the manifests of commits the snapshot did not know, so the committed object was
# left with no live reference; an unrelated dead letter's prefix hold kept it until the soak's
# `dlq resolve`, then the reaper deleted it while the head commit of main still listed it.


def test_a_write_lost_with_the_log_into_a_commit_the_mirror_saw_stays_protected(
        w: World) -> None:
    call(w, M.create_repository, "r", f"s3://{BUCKET}/rebuild-known/r/")
    call(w, M.write, "r", "main", "a", 10)
    w.track(None)

    x = call(w, M.write, "r", "main", "x", 10).address  # issued + written: both lost
    w.applied = len(w.model.events)  # lost with the broker's log: never applied
    commit = call(w, M.commit, "r", "main").commit.id  # published to the new log
    call(w, M.copy, "r", "main", "x", "main", "y")  # y shares x's address
    call(w, M.overwrite, "r", "main", "y", 10)  # ... and is overwritten: x's copy ends
    w.track(None)  # applied from the new log before the tracker noticed the loss
    lose_log(w, "r")

    assert w.model.repository("r").branches["main"].head == commit
    assert x not in w.model.truth(issued_ttl_respected=False).online_garbage
    assert state_of(w, "r", x) == "unreferenced"  # the mirror's view before the rebuild

    p = prepare(w.r, w.s3, "r")
    location = export(w, "r", p.nonce)
    rebuild(w.r, w.s3, "r", location, max_age_ms=MAX_AGE, by="test")

    # x is in the head commit of main: never reapable online (committed)
    assert not reapable(w, "r", x), f"x reapable, mirror state {state_of(w, 'r', x)}"
    assert state_of(w, "r", x) == "committed"


def test_control_the_same_write_replayed_late_as_dlq_replay_does_is_committed(
        w: World) -> None:
    """Control (passes): the dead-letter path. The write is not applied when published
    (dead-lettered), the commit and the copy's end are; `dlq replay` publishes it again and the
    tracker applies it after its successors: the reference lands in a committed token, so x is
    committed. Replay order does not matter here; the rebuild path above has no replay."""
    call(w, M.create_repository, "r", f"s3://{BUCKET}/replay-late/r/")
    call(w, M.write, "r", "main", "a", 10)
    w.track(None)
    start = len(w.model.events)
    x = call(w, M.write, "r", "main", "x", 10).address
    lost = w.model.events[start:]
    w.applied = len(w.model.events)  # dead-lettered: not applied
    call(w, M.commit, "r", "main")
    call(w, M.copy, "r", "main", "x", "main", "y")
    call(w, M.overwrite, "r", "main", "y", 10)
    w.track(None)
    assert reapable(w, "r", x)  # only the dead letter's hold keeps it now
    w.model.events.extend(lost)  # the replay, after its successors
    w.track(None)
    assert state_of(w, "r", x) == "committed"
    assert not reapable(w, "r", x)


# A rebuild applies its plan in chunks. Found by an adversarial review: a Redis that goes back
# between two chunks (a failover to a replica a few ms behind, a restart from an AOF whose last
# second was not fsynced) still holds the same prepare, so the later chunks (token drops, the
# lift) applied over a mirror that lost the earlier ones (marks, commit records). Each chunk
# now requires the count of chunks the previous one left, in the same slot.


def test_a_redis_that_goes_back_between_chunks_does_not_lift_the_flag_over_lost_marks(
        w: World, monkeypatch: pytest.MonkeyPatch) -> None:
    call(w, M.create_repository, "r", f"s3://{BUCKET}/atk7/r/")
    s = call(w, M.write, "r", "main", "s", 10).address
    w.track(None)                                   # s staged in main's token T: applied
    c2 = call(w, M.commit, "r", "main").commit.id   # c2 takes T: lost with the log
    w.applied = len(w.model.events)
    lose_log(w, "r")
    p = prepare(w.r, w.s3, "r")
    replica = slot_copy(w.r, "r")                  # a replica just behind: it has the prepare
    location = export(w, "r", p.nonce)

    real = rb._apply
    monkeypatch.setattr(rb, "CHUNK", 2)             # a repository with > CHUNK ops, in small
    state = {"failed_over": False}

    def failing_over(r: Any, repo: str, compact: list[list[Any]]) -> Any:
        out = real(r, repo, compact)
        if not state["failed_over"] and any(e[1] == 13 and e[2] == "commit" for e in compact):
            # the node acknowledged the chunks with the marks and the commit record, then
            # failed over to its replica; the rebuild's next call goes to the new primary
            fail_over_to(r, repo, replica)
            state["failed_over"] = True
        return out

    monkeypatch.setattr(rb, "_apply", failing_over)
    with contextlib.suppress(rb.RebuildError):  # refusing is a safe outcome
        rebuild(w.r, w.s3, "r", location, max_age_ms=MAX_AGE, by="attack7")
    assert state["failed_over"]
    lifted = not w.r.exists(RepoKeys("r").fail_closed)
    st = read_repo_state(w.r, "r")
    assert c2 in w.model.commits and w.model.repository("r").branches["main"].head == c2
    assert not (lifted and reapable(w, "r", s)), (
        f"flag lifted with the earlier chunks lost: s (in main's head commit {c2}) is "
        f"{state_of(w, 'r', s)!r} and reapable; mirror knows c2: {c2 in st.commits}")
    assert not lifted  # the next chunk saw the count go back: stale
    # A retry is a new run: it applies the whole plan again from its first chunk.
    rebuild(w.r, w.s3, "r", location, max_age_ms=MAX_AGE, by="retry")
    assert not w.r.exists(RepoKeys("r").fail_closed)
    assert state_of(w, "r", s) == "committed" and not reapable(w, "r", s)


async def test_a_redis_restored_from_an_older_copy_heals_by_itself(
        settings, s3, bucket) -> None:
    """End to end on Apache Kafka, Redis, MinIO: Redis is restored from a copy taken before a
    delete and a write were applied, and the broker no longer holds those records (deleted from
    the log's start, as retention does): replay is impossible, the repository fails closed, the
    tracker prepares a rebuild, the service exports its state, the flag lifts; the reaper then
    takes only the object whose delete the restored Redis lost."""
    import redis as redis_lib
    from aiokafka import AIOKafkaConsumer, TopicPartition
    from aiokafka.admin import AIOKafkaAdminClient, RecordsToDelete

    from core.clients import redis_sync
    from core.guards import fail_closed_reason
    from sim.log_loss import delete, repo_events, write
    from sim.testing import publish, wait_horizon
    from tracker.daemon import running_tracker

    s = settings.replace(topic_partitions=1, rebuild_interval_seconds=0.3)
    ns = f"s3://{bucket}/repo0/"
    for key in ("keep", "gone", "new"):
        s3.put_object(Bucket=bucket, Key=f"repo0/data/{key}", Body=b"x")
    raw = redis_lib.Redis.from_url(s.redis_url)
    async with running_tracker(s):
        await wait_horizon(s, await publish(s, [*repo_events(ns),
                                                write("repo0", ns + "data/keep", "k1"),
                                                write("repo0", ns + "data/gone", "g1")]))
    older = {k: raw.dump(k) for k in raw.scan_iter()}  # the copy Redis is restored from
    async with running_tracker(s):
        await wait_horizon(s, await publish(s, [delete("repo0", ns + "data/gone", "g1"),
                                                write("repo0", ns + "data/new", "n1")]))
    tp = TopicPartition(s.events_topic, 0)
    consumer = AIOKafkaConsumer(bootstrap_servers=s.kafka_bootstrap)
    await consumer.start()
    try:
        end = (await consumer.end_offsets([tp]))[tp]
    finally:
        await consumer.stop()
    admin = AIOKafkaAdminClient(bootstrap_servers=s.kafka_bootstrap)
    await admin.start()
    try:  # the log no longer holds the delete and the write (retention)
        await admin.delete_records({tp: RecordsToDelete(end)})
    finally:
        await admin.close()
    raw.flushall()
    for k, v in older.items():
        raw.restore(k, 0, v)
    raw.close()
    r = redis_sync(s)
    async with running_tracker(s, name="after-restore"):
        deadline = time.monotonic() + 30
        while not r.hget(RepoKeys("repo0").rebuild, "nonce"):
            assert time.monotonic() < deadline, "no rebuild prepared (not fail-closed?)"
            await asyncio.sleep(0.1)
        assert "log" in (fail_closed_reason(r, "repo0") or "")
        await _export_heal_and_reap(s, s3, r, ns, deadline)
    left = {o["Key"] for o in s3.list_objects_v2(Bucket=bucket, Prefix="repo0/data/")["Contents"]}
    assert left == {"repo0/data/keep", "repo0/data/new"}
    r.close()
