"""Differential tests: apply.lua (the implementation) against tracker.references (the spec).

The same events go through the pure machine and through the script on a real Redis; the
Redis state is read back into the same dataclasses and must be equal, timestamps included
(the script takes the test's clock through its ``now`` override)."""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from core.clock import redis_time_ms
from schemas import events as ev
from schemas.layout import REF_DEDUPE_WINDOW, RepoKeys
from sim.event_chaos import (
    ADDRS,
    NOW,
    NS,
    REPOS,
    apply_all,
    chaos_events,
    permuted_with_duplicates,
    ref_operations,
    run_both,
    sticky_only_difference,
)
from sim.gen import workload
from sim.testing import LuaTracker, apply_lua, canonical, lua_batches
from tracker import codec
from tracker.references import World
from tracker.state import read_repo_state


@settings(max_examples=200, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(seed=st.integers(0, 2**32), n=st.integers(0, 250), step=st.sampled_from([0, 700, 2000]))
# A batch ending in repository_deleted r0 then an overlapping repository_created r1 (refused:
# r0 still owned it); the redelivered batch must refuse r1 again, not register it.
@example(seed=146, n=41, step=0)
def test_lua_agrees_with_pure_machine_on_chaos(redis_client, seed, n, step):
    rng = random.Random(seed)
    items = chaos_events(rng, n)
    run_both(redis_client, items, [rng.randint(1, 12) for _ in range(n)], step=step)


def with_reap_records(rng: random.Random, items: list) -> list:
    """The chaos items with the reaper's ``addresses_reaped`` records among them: after its
    ("reap", a) steps (as the reaper publishes) and anywhere else (Redis forgot the reap, or
    a forged or misdirected record: addresses outside the namespace are dead-lettered)."""
    out: list = []
    for item in items:
        out.append(item)
        if isinstance(item, tuple) or rng.random() < 0.1:
            picked = rng.sample(ADDRS, rng.randint(1, 3))
            if isinstance(item, tuple) and rng.random() < 0.8:
                picked = [item[1]]
            repo = "r0" if rng.random() < 0.85 else rng.choice(REPOS[1:])
            out.append(ev.AddressesReaped(repository=repo, addresses=picked, reaper="rp",
                                          event_id=f"rp{rng.randrange(10**6)}"))
    return out


@settings(max_examples=100, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(seed=st.integers(0, 2**32), n=st.integers(0, 200), step=st.sampled_from([0, 700]))
def test_lua_agrees_with_pure_machine_on_reap_records(redis_client, seed, n, step):
    rng = random.Random(seed)
    items = with_reap_records(random.Random(seed + 1), chaos_events(rng, n))
    run_both(redis_client, items, [rng.randint(1, 12) for _ in range(len(items))], step=step)


@pytest.mark.parametrize("seed", range(3))
def test_lua_agrees_with_pure_machine_on_workloads(redis_client, seed):
    events = workload(seed, 3_000, repos=3, ttl_seconds=2.0)
    rng = random.Random(seed)
    r = redis_client
    world = World()
    gate = codec.Gate()
    offset, now = 0, 1_000_000
    while offset < len(events):
        n = rng.randint(1, 400)
        chunk = events[offset:offset + n]
        for e in chunk:
            assert world.apply(e, now).rejected is None
        batch, rejected = lua_batches(chunk, gate, offset)
        assert not rejected
        apply_lua(r, batch, now)
        offset += n
        now += rng.randint(0, 1_500)  # issued addresses expire along the way (ttl 2 s)
    for repo, state in world.repos.items():
        assert canonical(read_repo_state(r, repo)) == canonical(state)


def test_one_large_chunk_agrees_with_pure_machine(redis_client):
    """A chunk so large that the script's batched writes (the unreferenced index, token sets,
    address fields) go out in several calls of at most 2,000 values each."""
    events = workload(7, 12_000, repos=1, ttl_seconds=2.0)
    world, gate, now = World(), codec.Gate(), 1_000_000
    for e in events:
        assert world.apply(e, now).rejected is None
    batch, rejected = lua_batches(events, gate)
    assert not rejected
    apply_lua(redis_client, batch, now)
    (repo, state), = world.repos.items()
    assert len(state.unreferenced) > 1_000  # > 2,000 ZADD values in one call
    assert canonical(read_repo_state(redis_client, repo)) == canonical(state)


def test_script_uses_the_redis_clock(redis_client):
    r = redis_client
    gate = codec.Gate()
    events = [ev.RepositoryCreated(repository="r0", storage_namespace=NS, default_branch="main",
                                   default_retention_days=1.0),
              ev.ObjectDeleted(repository="r0", branch="main", staging_token="t", path="p",
                               address=NS + "data/a", ref_id="x")]
    batch, _ = lua_batches(events, gate)
    before = redis_time_ms(r)
    apply_lua(r, batch, None)
    after = redis_time_ms(r)
    since = read_repo_state(r, "r0").addresses[NS + "data/a"].since
    assert since is not None and before <= since <= after


def test_redelivered_offsets_are_skipped_and_noscript_recovers(redis_client):
    r = redis_client
    gate = codec.Gate()
    events = workload(7, 200, repos=1)
    batch, _ = lua_batches(events, gate)
    (res,) = apply_lua(r, batch, 5_000)
    assert res[0] == len(events) and res[1] == 0
    snapshot = read_repo_state(r, "repo-r0")
    r.script_flush()
    (res,) = apply_lua(r, batch, 9_000)
    assert res[0] == 0 and res[1] == len(events)
    assert read_repo_state(r, "repo-r0") == snapshot


@settings(max_examples=40, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(seed=st.integers(0, 10_000), order_seed=st.integers(0, 10_000), n=st.integers(0, 60),
       dups=st.integers(0, 15))
def test_lua_refs_converge_to_the_in_order_state(redis_client, seed, order_seed, n, dups):
    """The model service's ref events, in any order with duplicates, through the script (in
    random batches) end in the state the pure machine reaches in order."""
    r = redis_client
    r.flushall()
    events = ref_operations(seed, n)
    expected = apply_all(events, NOW).repos["r"]
    rng = random.Random(order_seed)
    shuffled = permuted_with_duplicates(events, rng, dups)
    lua = LuaTracker(r)
    i = 0
    while i < len(shuffled):
        k = rng.randint(1, 10)
        rejected, _ = lua.batch(shuffled[i:i + k], NOW, i)
        assert not rejected
        i += k
    got = read_repo_state(r, "r")
    assert got.branches == expected.branches
    assert got.tags == expected.tags
    assert got.ref_versions == expected.ref_versions
    sticky_only_difference(expected, got)


def test_the_scripts_dedupe_window_agrees_past_its_size(redis_client):
    """The window holds the last REF_DEDUPE_WINDOW ref event ids, oldest out first, as the
    pure machine does; duplicates inside it are counted, an evicted id is judged by version."""
    n = REF_DEDUPE_WINDOW + 20
    tags = [ev.TagCreated(repository="r0", tag=f"t{i % 7}", commit_id=c(i), ref_version=i + 1,
                          event_id=f"e{i}") for i in range(n)]
    items = [*tags, tags[0], tags[25], tags[-1], tags[-2]]  # evicted, kept, kept, kept
    world = run_both(redis_client, items, [2_000] * (n // 2_000 + 2))
    got = read_repo_state(redis_client, "r0")
    assert list(got.ref_seen) == list(world.repos["r0"].ref_seen)
    assert len(got.ref_seen) == REF_DEDUPE_WINDOW and "e19" not in got.ref_seen
    assert (got.ref_duplicates, got.ref_ids_reused) == (3, 0)
    assert redis_client.llen(RepoKeys("r0").ref_seen_order) == REF_DEDUPE_WINDOW


def c(i: int) -> str:
    return f"c{i % 3}"


def test_the_window_size_is_the_scripts():
    from tracker.state import APPLY_LUA

    assert f"local WINDOW = {REF_DEDUPE_WINDOW}" in APPLY_LUA


def _contradictions() -> dict[str, list[ev.Event]]:
    """The adversarial review's sequences (tests/integration/reaper/test_attack_online.py)."""
    a = NS + "data/a"

    def w(token: str, ref: str, branch: str = "main") -> ev.ObjectWritten:
        return ev.ObjectWritten(repository="r0", branch=branch, staging_token=token, path="p",
                                address=a, size=1, ref_id=ref)

    return {
        "removal_in_another_token": [
            w("t1", "r1"), ev.ObjectDeleted(repository="r0", branch="dev", staging_token="t2",
                                            path="p", address=a, ref_id="r1")],
        "reused_id": [w("t-dev", "r1", "dev"), w("t-main", "r1"),
                      ev.BranchDeleted(repository="r0", branch="dev", dropped_tokens=["t-dev"],
                                       ref_version=2)],
        "foreign_drop": [
            ev.BranchCreated(repository="r0", branch="main", staging_token="t-main",
                             ref_version=1),
            ev.BranchCreated(repository="r0", branch="dev", staging_token="t-dev",
                             ref_version=1),
            w("t-main", "r1"),
            ev.BranchDeleted(repository="r0", branch="dev", dropped_tokens=["t-main"],
                             ref_version=2)],
    }


@pytest.mark.parametrize("name", ["removal_in_another_token", "reused_id", "foreign_drop"])
@pytest.mark.parametrize("batch", [1, 10])
def test_lua_agrees_on_contradictions_in_every_order(redis_client, name, batch):
    """Every order of each sequence, one event per call or all in one: the script and the
    pure machine agree (doubt flag, least tokens, contested token, incidents), and the
    address stays kept with its reaper's recheck reading the record."""
    import itertools

    from schemas.liveness import Keep, judge

    events = _contradictions()[name]
    for order in itertools.permutations(events):
        world = run_both(redis_client, list(order), itertools.repeat(batch))
        state = world.repos["r0"]
        assert not state.reapable(NS + "data/a", 2**62, 0)
        rec = read_repo_state(redis_client, "r0").addresses[NS + "data/a"]
        j = judge(rec, redis_client.hgetall(RepoKeys("r0").tokens), now_ms=0,
                  horizon_ms=2**62, grace_ms=0)
        assert j.reason in (Keep.DOUBT, Keep.STAGED), (order, j)
