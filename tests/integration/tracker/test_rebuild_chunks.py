"""A rebuild's chunks in a slot that goes back or forward (found by two adversarial reviews).

A count alone was not unique to a run (ABA); each run now names itself:

The count in hd:{R}:rebuild says how many chunks were applied, not which: two runs that each
stopped after their first chunk (a failover's connection error, a crashed operator, the heal
loop retrying) leave count 2 over a slot that holds only the plan's chunk 0. A slot that then
goes back to the prepare (count 0, a lagging replica) and later forward to that state (the
first node, restarted from its AOF, promoted again when the second one fails) hands a third
run, which applied chunks 0 and 1 on the other node, exactly the count it expects: it applies
chunks 2.. over a mirror without chunk 1 (the manifest marks of the lost commit) and lifts.
"""

from __future__ import annotations

import contextlib
from typing import Any

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
    reapable,
    state_of,
)
from sim.testing import slot_copy
from sim.worlds import BUCKET, World, make_world
from tracker.rebuild import RebuildError, prepare, rebuild
from tracker.state import read_repo_state


@pytest.fixture
def w(settings, s3, redis_client) -> World:
    world = make_world(settings, s3, redis_client)
    world.model.upload_ttl_seconds = 0.05
    return world


@pytest.mark.parametrize("forward", [True, False], ids=["forward", "control"])
def test_two_stopped_runs_and_a_slot_that_goes_back_then_forward_do_not_lift_over_a_lost_chunk(
        w: World, monkeypatch: pytest.MonkeyPatch, forward: bool) -> None:
    call(w, M.create_repository, "r", f"s3://{BUCKET}/atk8/r/")
    s = call(w, M.write, "r", "main", "s", 10).address
    w.track(None)                                   # s staged in main's token T: applied
    c2 = call(w, M.commit, "r", "main").commit.id   # c2 takes T: lost with the log
    w.applied = len(w.model.events)
    lose_log(w, "r")
    p = prepare(w.r, w.s3, "r")
    at_prepare = slot_copy(w.r, "r")               # node B: a replica this far behind
    location = export(w, "r", p.nonce)

    real = rb._apply
    monkeypatch.setattr(rb, "CHUNK", 1)             # a repository with > CHUNK ops, in small
    seen: list[list[Any]] = []
    ctl: dict[str, Any] = {"budget": None, "after": None}

    def faulty(r: Any, repo: str, compact: list[list[Any]]) -> Any:
        if ctl["budget"] is not None:
            if ctl["budget"] == 0:                  # the node fails: the call errors
                raise ConnectionError("Connection reset by peer (failover)")
            ctl["budget"] -= 1
        out = real(r, repo, compact)
        seen.append(compact)
        if ctl["after"] is not None:
            ctl["after"]()
        return out

    monkeypatch.setattr(rb, "_apply", faulty)
    # Runs 1 and 2 (the operator, then the heal loop's retry): each applies the plan's chunk
    # 0 on node A and stops on a connection error. Node A: count 2, only chunk 0 applied.
    for _ in range(2):
        ctl["budget"] = 1
        with pytest.raises(ConnectionError):
            rebuild(w.r, w.s3, "r", location, max_age_ms=MAX_AGE, by="run")
    # node A now: count 2 (3c5f01b), only the plan's chunk 0 applied
    node_a = slot_copy(w.r, "r")
    # Node A fails; B (at the prepare: count 0) is promoted. Run 3 counts on from 0.
    fail_over_to(w.r, "r", at_prepare)
    assert w.r.hget(RepoKeys("r").rebuild, "chunks") is None
    calls = {"n": 0}

    def b_fails_a_returns() -> None:
        calls["n"] += 1
        if forward and calls["n"] == 2:             # B acknowledged chunks 0 and 1, then fails;
            fail_over_to(w.r, "r", node_a)         # A restarts from its AOF and is promoted

    ctl["budget"], ctl["after"] = None, b_fails_a_returns
    with contextlib.suppress(RebuildError):         # refusing is a safe outcome
        rebuild(w.r, w.s3, "r", location, max_age_ms=MAX_AGE, by="run3")
    assert calls["n"] >= 2
    lifted = not w.r.exists(RepoKeys("r").fail_closed)
    st = read_repo_state(w.r, "r")
    assert c2 in w.model.commits and w.model.repository("r").branches["main"].head == c2
    ops = [[e[1:] for e in c[1:-1]] for c in seen]
    assert not (lifted and reapable(w, "r", s)), (
        f"flag lifted over a mirror without the plan's chunk 1: s (in main's head commit "
        f"{c2}) is {state_of(w, 'r', s)!r} and reapable; mirror knows c2: {c2 in st.commits}; "
        f"chunks applied: {ops}")
    if not forward:  # control: run 3 on B alone applies the whole plan and lifts
        assert lifted and state_of(w, "r", s) == "committed"


@pytest.mark.parametrize("lost", [True, False], ids=["replica-behind", "control"])
def test_two_concurrent_rebuilds_and_a_replica_one_chunk_behind_do_not_lift_over_a_lost_chunk(
        w: World, monkeypatch: pytest.MonkeyPatch, lost: bool) -> None:
    """No forward jump needed: the operator's ``rebuild apply`` (A) and a tracker's heal (B)
    run together. B reads the count (1) after A's chunk 0; A applies chunk 1 (the marks,
    count 2); the slot fails over to a replica one chunk behind (count 1); B's chunk 0 passes
    its guard (1) and brings the count back to 2; A's chunk 2 passes its guard (2) and A
    goes on to lift, over a mirror that lost chunk 1."""
    import threading

    from tracker.rebuild import heal

    call(w, M.create_repository, "r", f"s3://{BUCKET}/atk8b/r/")
    s = call(w, M.write, "r", "main", "s", 10).address
    w.track(None)
    c2 = call(w, M.commit, "r", "main").commit.id   # lost with the log
    w.applied = len(w.model.events)
    lose_log(w, "r")
    p = prepare(w.r, w.s3, "r")
    location = export(w, "r", p.nonce)              # under _hardelete/exports/: heal finds it

    real = rb._apply
    monkeypatch.setattr(rb, "CHUNK", 1)
    ev = {k: threading.Event() for k in ("b_ready", "b_go", "b_done", "a_done")}
    b_thread: dict[str, Any] = {}
    n = {"a": 0, "b": 0}
    healed: dict[str, Any] = {}

    def run_b() -> None:
        healed["h"] = heal(w.r, w.s3, max_age_ms=MAX_AGE, by="tracker-2")

    def hook(r: Any, repo: str, compact: list[list[Any]]) -> Any:
        if threading.current_thread() is b_thread.get("t"):
            n["b"] += 1
            if n["b"] == 1:
                ev["b_ready"].set()
                assert ev["b_go"].wait(30)
                try:
                    return real(r, repo, compact)
                finally:
                    ev["b_done"].set()
            assert ev["a_done"].wait(30)
            return real(r, repo, compact)
        n["a"] += 1
        if n["a"] != 2:
            return real(r, repo, compact)
        # A is about to apply chunk 1: B starts (reads the count: 1) and waits in its chunk 0
        b_thread["t"] = threading.Thread(target=run_b)
        b_thread["t"].start()
        assert ev["b_ready"].wait(30)
        replica = slot_copy(r, repo)               # one chunk behind
        out = real(r, repo, compact)                # chunk 1: the marks (count 2)
        if lost:
            fail_over_to(r, repo, replica)         # acknowledged, then lost: count 1
        ev["b_go"].set()
        assert ev["b_done"].wait(30)                # B's chunk 0: count 2 again
        return out

    monkeypatch.setattr(rb, "_apply", hook)
    try:
        with contextlib.suppress(RebuildError):
            rebuild(w.r, w.s3, "r", location.replace("/state.json", ""), max_age_ms=MAX_AGE,
                    by="operator")
    finally:
        ev["a_done"].set()
        ev["b_go"].set()
        if "t" in b_thread:
            b_thread["t"].join(30)
    assert n["a"] >= 2 and n["b"] >= 1, (n, healed)
    lifted = not w.r.exists(RepoKeys("r").fail_closed)
    assert w.model.repository("r").branches["main"].head == c2
    assert not (lifted and reapable(w, "r", s)), (
        f"flag lifted over a mirror without chunk 1: s (in main's head commit) is "
        f"{state_of(w, 'r', s)!r} and reapable; heal: {healed}")
    if not lost:  # control: B goes stale, A lifts over the whole plan
        assert lifted and state_of(w, "r", s) == "committed"
