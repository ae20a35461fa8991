"""Property tests of the pure reference state machine (tracker.references): order and duplicate
independence, safety (nothing live is reapable), and agreement with the model service's ground
truth for random model workloads."""

from __future__ import annotations

import copy
import dataclasses
import random

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from schemas import events as ev
from schemas.layout import AddressState
from sim.event_chaos import (
    NOW,
    REF_NS,
    apply_all,
    permuted_with_duplicates,
    ref_operations,
    sticky_only_difference,
)
from sim.gen import workload
from sim.model import ManualClock, Model, Workload, run_workload, seeded_ids
from sim.testing import canonical
from tracker import codec
from tracker import references as refs_module
from tracker.references import RepoState, World, live_refs

ADDRESS_EVENTS = (ev.ObjectWritten, ev.ObjectCopied, ev.ObjectDeleted, ev.AddressIssued)


def shuffle_segments(events: list[ev.Event], rng: random.Random) -> list[ev.Event]:
    """Any permutation of the add/remove/issue events between two lifecycle events (which stay
    in place): this interleaves different addresses and reorders the events of one address."""
    out: list[ev.Event] = []
    segment: list[ev.Event] = []
    for e in events:
        if isinstance(e, ADDRESS_EVENTS):
            segment.append(e)
        else:
            rng.shuffle(segment)
            out += segment
            segment = []
            out.append(e)
    rng.shuffle(segment)
    return out + segment


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 10_000), order_seed=st.integers(0, 10_000))
def test_order_of_address_events_between_lifecycle_events_does_not_matter(seed, order_seed):
    events = workload(seed, 600, repos=2)
    base = apply_all(events)
    shuffled = apply_all(shuffle_segments(events, random.Random(order_seed)))
    for repo in base.repos:
        assert canonical(base.repos[repo]) == canonical(shuffled.repos[repo])


def chaos(rng: random.Random, n: int) -> list[ev.Event]:
    """Small pools, contract violations included (removes naming a ref of another address,
    adds arriving after their token was committed or dropped, tokens committed after being
    dropped, a ref id reused in another token, a branch event naming another branch's
    token...). Most refs keep to one token; sometimes one is named with another (doubt)."""
    ns = "s3://b/r/"
    addrs = [ns + f"data/{i}" for i in range(4)]
    refs, toks = [f"r{i}" for i in range(6)], [f"t{i}" for i in range(3)]
    out: list[ev.Event] = [ev.RepositoryCreated(repository="r", storage_namespace=ns,
                                                default_branch="main",
                                                default_retention_days=1.0)]
    for _ in range(n):
        c = rng.choice
        k = rng.randrange(8)
        ref = c(refs)
        tok = toks[refs.index(ref) % len(toks)] if rng.random() < 0.9 else c(toks)
        branch = "main" if rng.random() < 0.85 else "dev"
        if k < 3:
            out.append(ev.ObjectWritten(repository="r", branch="main", staging_token=tok,
                                        path="p", address=c(addrs), size=1, ref_id=ref))
        elif k < 5:
            out.append(ev.ObjectDeleted(repository="r", branch="main", staging_token=tok,
                                        path="p", address=c(addrs), ref_id=ref))
        elif k == 5:
            out.append(ev.AddressIssued(repository="r", address=c(addrs), ttl_seconds=60.0))
        elif k == 6:
            out.append(ev.CommitCreated(repository="r", branch=branch, commit_id=c(["c1", "c2"]),
                                        parents=[], sealed_tokens=[c(toks)],
                                        staging_token=c(toks), committed_at=1.0,
                                        manifest=ns + "m", ref_version=rng.randrange(5)))
        else:
            out.append(ev.BranchReset(repository="r", branch=branch, dropped_tokens=[c(toks)],
                                      staging_token=c(toks), ref_version=rng.randrange(5)))
    return out


@settings(max_examples=150, deadline=None)
@given(seed=st.integers(0, 10_000), order_seed=st.integers(0, 10_000), n=st.integers(0, 80))
def test_reordering_within_segments_is_harmless_even_for_contract_violations(seed, order_seed,
                                                                             n):
    events = chaos(random.Random(seed), n)
    a = apply_all(events).repos["r"]
    b = apply_all(events[:1] + shuffle_segments(events[1:], random.Random(order_seed))).repos["r"]
    sticky_only_difference(a, b)


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 10_000), dup_seed=st.integers(0, 10_000))
def test_duplicates_change_nothing(seed, dup_seed):
    """A retried publish may deliver an event again, any time later (tags included: the
    workload's ref events carry ref_version)."""
    events = workload(seed, 600, repos=2)
    rng = random.Random(dup_seed)
    with_dups = list(events)
    for _ in range(60):
        i = rng.randrange(len(events))
        j = rng.randrange(i, len(with_dups) + 1)
        # insert after the original's position in with_dups
        pos = with_dups.index(events[i])
        with_dups.insert(max(j, pos + 1), events[i])
    base, dup = apply_all(events), apply_all(with_dups)
    for repo in base.repos:
        assert canonical(base.repos[repo], counters=False) == canonical(dup.repos[repo],
                                                                        counters=False)


@settings(max_examples=150, deadline=None)
@given(seed=st.integers(0, 10_000), n=st.integers(0, 120), step=st.integers(0, 5_000))
def test_nothing_live_is_ever_reapable(seed, n, step):
    rng = random.Random(seed)
    w = World()
    now = NOW
    for e in chaos(rng, n):
        w.apply(e, now)
        now += rng.randint(0, step)
        state = w.repos["r"]
        for address, rec in state.addresses.items():
            alive = (live_refs(state, address) or rec.committed
                     or (rec.issued_until is not None and rec.issued_until > now))
            if alive:
                assert not state.reapable(address, now, 0), (address, rec)
            if rec.state is AddressState.UNREFERENCED:
                assert state.unreferenced[address] == rec.since
                assert not live_refs(state, address) and not rec.committed


def _reap_in_redis(state: RepoState, address: str, now: int) -> None:
    """What the reaper's claim and completion write to Redis (not to the log)."""
    rec = state.addresses[address]
    rec.state, rec.since, rec.reaped_at = AddressState.REAPED, None, now
    state.unreferenced.pop(address, None)


@settings(max_examples=150, deadline=None)
@given(seed=st.integers(0, 10_000), n=st.integers(0, 120), snap=st.floats(0, 1))
def test_the_log_alone_restores_what_the_reaper_deleted(seed, n, snap):
    """A Redis restored from an older copy (a snapshot of the state after any prefix of the
    log) and brought forward by replaying the log ends in the state of the Redis that never
    went back - reaped addresses and incidents included - because the reaper publishes
    ``addresses_reaped`` before it marks Redis. Without that record the replayed state would
    forget the reaps, and a later reference to a reaped address would be no incident."""
    rng = random.Random(seed)
    log: list[ev.Event] = []
    live = World()
    snapshot: World | None = None
    at = int(snap * n)
    now = NOW
    for i, e in enumerate(chaos(rng, n)):
        if i == at:
            snapshot = copy.deepcopy(live)
            snap_len = len(log)
        log.append(e)
        live.apply(e, now)
        state = live.repos["r"]
        # The reaper, now and then, takes an unreferenced address: Redis first, then the log.
        gone = sorted(a for a, rec in state.addresses.items()
                      if rec.state in (AddressState.UNREFERENCED, AddressState.ISSUED))
        if gone and rng.random() < 0.3:
            address = rng.choice(gone)
            _reap_in_redis(state, address, now)
            record = ev.AddressesReaped(repository="r", addresses=[address], reaper="x")
            log.append(record)
            assert live.apply(record, now).incidents == []  # Redis already knew
    if snapshot is None:
        snapshot, snap_len = copy.deepcopy(live), len(log)
    for e in log[snap_len:]:  # the replay after the restore
        snapshot.apply(e, now)
    assert canonical(snapshot.repos["r"]) == canonical(live.repos["r"])


def test_a_reap_record_redis_does_not_know_makes_the_address_reaped():
    ns = "s3://b/r/"
    w = apply_all([ev.RepositoryCreated(repository="r", storage_namespace=ns,
                                        default_branch="main", default_retention_days=1.0)])
    st_ = w.repos["r"]
    a, b, c = ns + "data/a", ns + "data/b", ns + "data/c"
    for ref, address in (("r1", a), ("r2", b)):
        w.apply(ev.ObjectWritten(repository="r", branch="m", staging_token="t", path=ref,
                                 address=address, size=1, ref_id=ref), NOW)
    w.apply(ev.ObjectDeleted(repository="r", branch="m", staging_token="t", path="r1",
                             address=a, ref_id="r1"), NOW)
    record = ev.AddressesReaped(repository="r", addresses=[a, b, c], reaper="x", event_id="rp")
    out = w.apply(record, NOW + 7)
    # b still had a live reference: its data is gone, an incident; a and c simply reaped.
    assert [(i.address, i.ref_id, i.type, i.event_id) for i in out.incidents] == [
        (b, "r2", "addresses_reaped", "rp")]
    for address in (a, b, c):
        assert st_.addresses[address].state is AddressState.REAPED
        assert st_.addresses[address].reaped_at == NOW + 7
    assert a not in st_.unreferenced
    assert w.apply(record, NOW + 8).incidents == []  # a duplicate changes nothing
    outside = ev.AddressesReaped(repository="r", addresses=[a, "s3://other/x"], reaper="x")
    assert "outside namespace" in (w.apply(outside, NOW).rejected or "")


def test_admission_rejects_without_applying():
    w = World()
    ns = "s3://b/r/"
    created = ev.RepositoryCreated(repository="r", storage_namespace=ns, default_branch="main",
                                   default_retention_days=1.0)
    assert w.apply(ev.ObjectDeleted(repository="r", branch="m", staging_token="t", path="p",
                                    address=ns + "data/x", ref_id="x"), NOW).rejected \
        == "unknown repository 'r'"
    assert w.apply(created, NOW).rejected is None
    for address, fragment in [("s3://other/data/x", "outside namespace"),
                              (ns + "_hardelete/reports/r", "reserved"),
                              (ns + "_lakefs/x", "reserved"), (ns, "not a plain object key"),
                              (ns + "data/../x", "not a plain object key")]:
        out = w.apply(ev.ObjectWritten(repository="r", branch="m", staging_token="t", path="p",
                                       address=address, size=1, ref_id="r1"), NOW)
        assert out.rejected and fragment in out.rejected, (address, out.rejected)
    conflicting = ev.RepositoryCreated(repository="r", storage_namespace="s3://b/other/",
                                       default_branch="main", default_retention_days=1.0)
    assert "already exists" in (w.apply(conflicting, NOW).rejected or "")
    assert w.apply(created, NOW).rejected is None  # an exact duplicate is fine
    assert w.repos["r"].addresses == {}


def test_incident_for_a_live_reference_to_a_reaped_address():
    ns = "s3://b/r/"
    w = apply_all([ev.RepositoryCreated(repository="r", storage_namespace=ns,
                                        default_branch="main", default_retention_days=1.0)])
    st_ = w.repos["r"]
    a = ns + "data/x"
    w.apply(ev.ObjectDeleted(repository="r", branch="m", staging_token="t", path="p",
                             address=a, ref_id="r1"), NOW)
    st_.addresses[a].state = AddressState.REAPED
    late = ev.ObjectCopied(repository="r", branch="m", staging_token="t2", path="q", address=a,
                           size=1, ref_id="r2", source_read_at=1.0, event_id="late")
    out = w.apply(late, NOW + 5)
    assert [(i.address, i.event_id, i.type, i.ref_id, i.at_ms) for i in out.incidents] == [
        (a, "late", "object_copied", "r2", NOW + 5)]
    assert st_.addresses[a].state is AddressState.REAPED  # the tracker never leaves reaped
    assert w.apply(late, NOW + 6).incidents == []  # a duplicate is not a second incident
    # The removed reference arriving late is no incident: it was never alive.
    assert w.apply(ev.ObjectWritten(repository="r", branch="m", staging_token="t", path="p",
                                    address=a, size=1, ref_id="r1"), NOW).incidents == []


def test_late_duplicate_lifecycle_events_do_not_move_a_branch_back():
    ns = "s3://b/r/"
    created = ev.BranchCreated(repository="r", branch="dev", staging_token="t1", ref_version=1)
    commit = ev.CommitCreated(repository="r", branch="dev", commit_id="c1", parents=[],
                              sealed_tokens=["t1"], staging_token="t2", committed_at=1.0,
                              manifest=ns + "m", ref_version=2)
    deleted = ev.BranchDeleted(repository="r", branch="dev", dropped_tokens=["t2"],
                               ref_version=3)
    again = ev.BranchCreated(repository="r", branch="dev", staging_token="t3", ref_version=4)
    w = apply_all([ev.RepositoryCreated(repository="r", storage_namespace=ns,
                                        default_branch="main", default_retention_days=1.0),
                   created, commit, created, commit])
    assert w.repos["r"].branches["dev"].head == "c1"
    assert w.repos["r"].branches["dev"].staging_token == "t2"
    for e in (deleted, again, deleted, commit, created):
        w.apply(e, NOW)
    assert w.repos["r"].branches["dev"].staging_token == "t3"


# --- against the model service's ground truth --------------------------------------------------

def tracked_categories(state: RepoState, now_ms: int) -> dict[str, set[str]]:
    out: dict[str, set[str]] = {"committed": set(), "staged": set(), "issued": set(),
                                "garbage": set()}
    for address, rec in state.addresses.items():
        if rec.state is AddressState.COMMITTED:
            out["committed"].add(address)
        elif rec.state is AddressState.STAGED:
            out["staged"].add(address)
        elif rec.state is AddressState.ISSUED and rec.issued_until and rec.issued_until > now_ms:
            out["issued"].add(address)
        else:
            out["garbage"].add(address)
    return out


@pytest.mark.parametrize("seed", range(12))
def test_tracked_state_matches_the_models_ground_truth(seed):
    clock = ManualClock(step=0.25)
    model = Model(clock=clock, upload_ttl_seconds=20.0, new_id=seeded_ids(seed))
    wl = Workload(seed=seed, ops=400, repos=2, branches=3, paths=12)
    events = run_workload(model, wl)
    world = World()
    for e in events:  # the tracker applies each event when (or after) it is emitted
        assert world.apply(e, round(e.emitted_at * 1000)).rejected is None
    now = clock.advance(5.0)
    truth = model.truth(now=now)
    now_ms = round(now * 1000)
    got: dict[str, set[str]] = {"committed": set(), "staged": set(), "issued": set(),
                                "garbage": set()}
    for state in world.repos.values():
        for k, v in tracked_categories(state, now_ms).items():
            got[k] |= v
    # The tracker cannot see manifests: superseded entries are committed for it (terminal
    # online; the reconciler reclaims them).
    assert got["committed"] == truth.committed | truth.superseded
    assert got["staged"] == truth.staged_live
    assert got["issued"] == truth.issued_unexpired
    assert got["garbage"] == truth.online_garbage
    # Safety of time: the tracker never starts a grace window before the truth does.
    for state in world.repos.values():
        for address in got["garbage"] & set(state.addresses):
            since = state.unreferenced[address]
            assert since >= round(truth.garbage_since[address] * 1000) - 1, address
            assert not state.reapable(address, round(truth.garbage_since[address] * 1000) - 2,
                                      0)
    assert truth.online_garbage and truth.committed  # the workload exercised both


def test_a_duplicate_address_issued_does_not_extend_the_protection():
    ns = "s3://b/r/"
    w = apply_all([ev.RepositoryCreated(repository="r", storage_namespace=ns,
                                        default_branch="main", default_retention_days=1.0)])
    issued = ev.AddressIssued(repository="r", address=ns + "data/u", ttl_seconds=10.0)
    w.apply(issued, NOW)
    w.apply(issued, NOW + 9_000)
    rec = w.repos["r"].addresses[ns + "data/u"]
    assert rec.issued_until == NOW + 10_000 and rec.state is AddressState.ISSUED
    w.apply(issued, NOW + 10_000)  # expired: a touch makes it unreferenced from now
    assert rec.state is AddressState.UNREFERENCED and rec.since == NOW + 10_000
    assert w.repos["r"].unreferenced[ns + "data/u"] == NOW + 10_000


# --- refs converge like references do (ref_version) --------------------------------------------

@settings(max_examples=150, deadline=None)
@given(seed=st.integers(0, 10_000), order_seed=st.integers(0, 10_000), n=st.integers(0, 60),
       dups=st.integers(0, 15))
def test_refs_converge_to_the_in_order_state_under_any_order_and_duplication(seed, order_seed,
                                                                             n, dups):
    events = ref_operations(seed, n)
    in_order = apply_all(events).repos["r"]
    shuffled = apply_all(permuted_with_duplicates(events, random.Random(order_seed), dups))
    got = shuffled.repos["r"]
    assert got.branches == in_order.branches
    assert got.tags == in_order.tags
    assert got.ref_versions == in_order.ref_versions
    assert got.ref_seen == in_order.ref_seen  # (as dicts: order aside)
    sticky_only_difference(in_order, got)


def test_the_model_publishes_a_version_on_every_ref_event():
    events = ref_operations(5, 200)
    ref_events = (ev.BranchCreated, ev.CommitCreated, ev.BranchReset, ev.BranchDeleted,
                  ev.TagCreated, ev.TagDeleted)
    seen: dict[str, int] = {}
    kinds = set()
    for e in events:
        if isinstance(e, ref_events):
            kinds.add(type(e))
            assert e.ref_version is not None, e
            ref = ("t:" + e.tag) if isinstance(e, ev.TagCreated | ev.TagDeleted) \
                else "b:" + e.branch
            assert e.ref_version > seen.get(ref, 0), e  # strictly increasing per ref
            seen[ref] = e.ref_version
    assert kinds == set(ref_events)


def _repo() -> ev.RepositoryCreated:
    return ev.RepositoryCreated(repository="r", storage_namespace=REF_NS, default_branch="main",
                                default_retention_days=1.0)


def test_a_late_duplicate_tag_deleted_does_not_delete_the_tag_created_again():
    created = ev.TagCreated(repository="r", tag="v1", commit_id="c1", ref_version=1)
    deleted = ev.TagDeleted(repository="r", tag="v1", ref_version=2)
    again = ev.TagCreated(repository="r", tag="v1", commit_id="c2", ref_version=3)
    assert apply_all([_repo(), created, deleted, again, deleted]).repos["r"].tags == {"v1": "c2"}
    # a late create cannot resurrect a deleted tag (the delete left a versioned tombstone)
    st_ = apply_all([_repo(), deleted, created]).repos["r"]
    assert st_.tags == {} and st_.ref_versions == {"t:v1": 2}


def test_a_retried_tag_created_after_the_delete_does_not_resurrect_the_tag():
    """The finding "refs still move on duplicates": the same event (same event_id) published
    again after the tag's deletion, and a late duplicate delete after the tag came back."""
    created = ev.TagCreated(repository="r", tag="v1", commit_id="c1", ref_version=1)
    deleted = ev.TagDeleted(repository="r", tag="v1", ref_version=2)
    again = ev.TagCreated(repository="r", tag="v1", commit_id="c2", ref_version=3)
    st_ = apply_all([_repo(), created, deleted, created]).repos["r"]
    assert st_.tags == {} and st_.ref_duplicates == 1
    st_ = apply_all([_repo(), created, deleted, again, deleted, created]).repos["r"]
    assert st_.tags == {"v1": "c2"} and st_.ref_duplicates == 2
    assert st_.ref_seen == {e.event_id: f"t:v1|{e.ref_version}" for e in (created, deleted, again)}


def test_a_duplicate_is_known_by_its_id_and_a_reused_id_is_not_dropped():
    """Within the window the same id, ref and version is a duplicate whatever the versions
    recorded meanwhile; the same id on another ref or version is a publisher reusing ids: it
    is applied by the version rule (dropping it could lose the tag that retains a commit)."""
    created = ev.TagCreated(repository="r", tag="v1", commit_id="c1", ref_version=1,
                            event_id="same")
    reused = ev.TagCreated(repository="r", tag="v2", commit_id="c2", ref_version=1,
                           event_id="same")
    st_ = apply_all([_repo(), created, reused, created, reused]).repos["r"]
    assert st_.tags == {"v1": "c1", "v2": "c2"}
    assert (st_.ref_duplicates, st_.ref_ids_reused) == (1, 2)  # (v2's own repeat: stale version)
    assert st_.ref_seen == {"same": "t:v1|1"}


def test_the_dedupe_window_keeps_the_last_ids(monkeypatch):
    monkeypatch.setattr(refs_module, "REF_DEDUPE_WINDOW", 3)
    tags = [ev.TagCreated(repository="r", tag=f"t{i}", commit_id="c", ref_version=1,
                          event_id=f"e{i}") for i in range(5)]
    st_ = apply_all([_repo(), *tags]).repos["r"]
    assert list(st_.ref_seen) == ["e2", "e3", "e4"]
    st_ = apply_all([_repo(), *tags, tags[0], tags[4]]).repos["r"]
    # e0 left the window: not known as a duplicate, and still no change (its version is not
    # above the ref's): the version rule holds beyond the window
    assert st_.ref_duplicates == 1 and st_.tags == {f"t{i}": "c" for i in range(5)}
    assert list(st_.ref_seen) == ["e3", "e4", "e0"]


def test_a_ref_event_without_a_version_is_refused_with_a_reason():
    for e in (ev.TagCreated(repository="r", tag="v1", commit_id="c1", ref_version=1),
              ev.BranchCreated(repository="r", branch="b", staging_token="t", ref_version=1),
              ev.CommitCreated(repository="r", branch="b", commit_id="c", parents=[],
                               sealed_tokens=[], staging_token="t", committed_at=1.0,
                               manifest=REF_NS + "m", ref_version=1),
              ev.BranchReset(repository="r", branch="b", dropped_tokens=[], staging_token="t",
                             ref_version=1),
              ev.BranchDeleted(repository="r", branch="b", dropped_tokens=[], ref_version=1),
              ev.TagDeleted(repository="r", tag="v1", ref_version=1)):
        assert e.TYPE in ev.REF_EVENT_TYPES
        body = orjson.loads(ev.encode(e))
        for value in (None, "missing"):
            if value is None:
                body["ref_version"] = None
            else:
                del body["ref_version"]
            assert codec.fast_body(dict(body)) is None
            with pytest.raises(ev.EventError, match="ref_version"):
                codec.parse(orjson.dumps(body))
    assert {t for t, cls in ev.EVENT_TYPES.items()
            if "ref_version" in {f.name for f in dataclasses.fields(cls)}} == ev.REF_EVENT_TYPES


def test_commit_and_branch_delete_reordered_end_as_in_order():
    """In order the branch is gone; delivered delete-then-commit, v1 kept a stale record."""
    created = ev.BranchCreated(repository="r", branch="dev", staging_token="t1", ref_version=1)
    commit = ev.CommitCreated(repository="r", branch="dev", commit_id="c1", parents=[],
                              sealed_tokens=["t1"], staging_token="t2", committed_at=1.0,
                              manifest=REF_NS + "m", ref_version=2)
    deleted = ev.BranchDeleted(repository="r", branch="dev", dropped_tokens=["t2"],
                               ref_version=3)
    in_order = apply_all([_repo(), created, commit, deleted]).repos["r"]
    reordered = apply_all([_repo(), created, deleted, commit]).repos["r"]
    assert "dev" not in in_order.branches
    assert canonical(reordered) == canonical(in_order)


def test_a_versioned_reset_carries_the_whole_record():
    """A reset delivered before the commit it follows keeps the head it names (v1 would keep
    the previous head, and the later commit would be ignored as stale)."""
    created = ev.BranchCreated(repository="r", branch="main", staging_token="t1", ref_version=1)
    commit = ev.CommitCreated(repository="r", branch="main", commit_id="c1", parents=[],
                              sealed_tokens=["t1"], staging_token="t2", committed_at=1.0,
                              manifest=REF_NS + "m", ref_version=2)
    reset = ev.BranchReset(repository="r", branch="main", dropped_tokens=["t2"],
                           staging_token="t3", head="c1", ref_version=3)
    for order in ([created, commit, reset], [created, reset, commit], [reset, commit, created]):
        b = apply_all([_repo(), *order]).repos["r"].branches["main"]
        assert (b.head, b.staging_token) == ("c1", "t3"), order


# --- contradictions: a reference id or a token named twice (adversarial review) ------------

NS_R = "s3://b/r/"
A = NS_R + "data/a"


def _write(token: str, ref: str, branch: str = "main") -> ev.ObjectWritten:
    return ev.ObjectWritten(repository="r", branch=branch, staging_token=token, path="p",
                            address=A, size=1, ref_id=ref)


def _delete(token: str, ref: str, branch: str = "main") -> ev.ObjectDeleted:
    return ev.ObjectDeleted(repository="r", branch=branch, staging_token=token, path="p",
                            address=A, ref_id=ref)


ATTACKS = {
    # a removal naming another token than the reference's own
    "removal_in_another_token": [_write("t1", "r1"), _delete("t2", "r1", "dev")],
    # the same reference id staged in two tokens, one of them dropped
    "reused_id": [_write("t-dev", "r1", "dev"), _write("t-main", "r1"),
                  ev.BranchDeleted(repository="r", branch="dev", dropped_tokens=["t-dev"],
                                   ref_version=2)],
    # a branch delete dropping another branch's open token
    "foreign_drop": [ev.BranchCreated(repository="r", branch="main", staging_token="t-main",
                                      ref_version=1),
                     ev.BranchCreated(repository="r", branch="dev", staging_token="t-dev",
                                      ref_version=1),
                     _write("t-main", "r1"),
                     ev.BranchDeleted(repository="r", branch="dev", dropped_tokens=["t-main"],
                                      ref_version=2)],
}


@pytest.mark.parametrize("name", sorted(ATTACKS))
def test_a_contradiction_keeps_the_address_in_every_order(name):
    """Each sequence of the adversarial review, in every order: the address is never
    reapable, the record is the same, and the breach is one incident."""
    import itertools

    root = ev.RepositoryCreated(repository="r", storage_namespace=NS_R, default_branch="main",
                                default_retention_days=1.0)
    results = []
    for order in itertools.permutations(ATTACKS[name]):
        st_ = apply_all([root, *order]).repos["r"]
        assert not st_.reapable(A, NOW + 10**9, 0), order
        assert st_.addresses[A].state is AddressState.STAGED, order
        assert len([i for i in st_.incidents if i.kind]) == 1, st_.incidents
        results.append(st_)
    for st_ in results[1:]:
        sticky_only_difference(results[0], st_)


def test_a_removal_naming_the_adds_token_still_ends_the_reference():
    root = ev.RepositoryCreated(repository="r", storage_namespace=NS_R, default_branch="main",
                                default_retention_days=1.0)
    st_ = apply_all([root, _write("t1", "r1"), _delete("t1", "r1")]).repos["r"]
    assert st_.addresses[A].state is AddressState.UNREFERENCED and not st_.incidents
    assert st_.reapable(A, NOW, 0)


def test_a_contested_token_is_kept_until_a_commit_takes_it():
    """Contested outranks dropped (no branch event ends it) and is outranked by committed."""
    from schemas.layout import TokenState

    root = ev.RepositoryCreated(repository="r", storage_namespace=NS_R, default_branch="main",
                                default_retention_days=1.0)
    events = ATTACKS["foreign_drop"]
    st_ = apply_all([root, *events]).repos["r"]
    assert st_.token_state("t-main") is TokenState.DOUBT and st_.token_owners["t-main"] == ""
    out = World()
    for e in [root, *events]:
        out.apply(e, NOW)
    s2 = out.repos["r"]
    out.apply(ev.BranchReset(repository="r", branch="main", dropped_tokens=["t-main"],
                             staging_token="t2", ref_version=5), NOW)
    assert s2.token_state("t-main") is TokenState.DOUBT
    out.apply(ev.CommitCreated(repository="r", branch="main", commit_id="c1", parents=[],
                               sealed_tokens=["t-main"], staging_token="t3", committed_at=1.0,
                               manifest=NS_R + "m", ref_version=6), NOW)
    assert s2.token_state("t-main") is TokenState.COMMITTED
    assert s2.addresses[A].state is AddressState.COMMITTED


def test_a_contest_revealed_while_the_reaper_holds_the_address_is_an_incident():
    """The foreign drop arrives first; the reaper claims the address; then main's
    branch_created reveals the contest: the token is kept again and, the reaper holding the
    address, each reference it keeps is an incident (its recheck keeps a doubt token)."""
    root = ev.RepositoryCreated(repository="r", storage_namespace=NS_R, default_branch="main",
                                default_retention_days=1.0)
    w = apply_all([root, _write("t-main", "r1"),
                   ev.BranchDeleted(repository="r", branch="dev", dropped_tokens=["t-main"],
                                    ref_version=2)])
    st_ = w.repos["r"]
    assert st_.reapable(A, NOW, 0)
    _reap_in_redis(st_, A, NOW)
    out = w.apply(ev.BranchCreated(repository="r", branch="main", staging_token="t-main",
                                   ref_version=1, event_id="late"), NOW + 1)
    assert sorted((i.kind, i.address, i.ref_id) for i in out.incidents) == [
        ("", A, "r1"), ("token_contested", "", "")]
