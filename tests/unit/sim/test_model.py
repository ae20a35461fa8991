"""The model service: pure semantics and ground truth (no servers), property tests over seeded
workloads, and the service layer against the real S3 server and broker."""

from __future__ import annotations

import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from schemas import events as ev
from schemas.layout import TokenState
from sim.model import (
    DEFAULT_MIX,
    Category,
    Entry,
    ManualClock,
    Model,
    ModelError,
    ObjectKind,
    OpEvents,
    OpKind,
    Workload,
    apply_op,
    run_workload,
    seeded_ids,
    slice_id,
)

NS = "s3://bucket/repo/"
T0 = 1_700_000_000.0
TTL = 600.0


def new_model(step: float = 0.0, seed: int | None = 1) -> tuple[Model, ManualClock]:
    clock = ManualClock(T0, step)
    ids = seeded_ids(seed) if seed is not None else (lambda: uuid.uuid4().hex)
    model = Model(clock=clock, upload_ttl_seconds=TTL, new_id=ids)
    model.create_repository("repo", NS)
    model.create_branch("repo", "dev")
    return model, clock


def address_of(out: OpEvents) -> str:
    assert out.address is not None
    return out.address


def only(events: list[ev.Event], cls: type[ev.Event]) -> Any:
    found = [e for e in events if isinstance(e, cls)]
    assert len(found) == 1, events
    return found[0]


# --- repositories, addresses ------------------------------------------------------------------


def test_create_repository_events_and_validation() -> None:
    model = Model(clock=ManualClock(T0))
    out = model.create_repository("r1", "s3://b/r1/", default_retention_days=3,
                                  branch_retention_days={"main": 30})
    created = only(out, ev.RepositoryCreated)
    branch = only(out, ev.BranchCreated)
    assert (created.storage_namespace, created.default_branch) == ("s3://b/r1/", "main")
    assert created.branch_retention_days == {"main": 30}
    assert branch.staging_token == model.repositories["r1"].branches["main"].staging_token
    assert branch.source_commit is None
    assert model.events == list(out)
    for bad_ns in ("s3://b/r2", "b/r2/", "s3:///r2/"):
        with pytest.raises(ModelError):
            model.create_repository("r2", bad_ns)
    with pytest.raises(ModelError, match="overlaps"):
        model.create_repository("r2", "s3://b/r1/inner/")
    with pytest.raises(ModelError, match="exists"):
        model.create_repository("r1", "s3://b/other/")
    with pytest.raises(ModelError, match="invalid repository"):
        model.create_repository("{r}", "s3://b/x/")
    assert len(model.events) == 2  # refused operations publish nothing


def test_addresses_are_in_reverse_sorted_hourly_slices() -> None:
    model, clock = new_model()
    first = model.write("repo", "main", "a", 1).address
    clock.advance(2 * 3600)
    second = model.write("repo", "main", "b", 1).address
    assert first and second
    for address in (first, second):
        assert address.startswith(f"{NS}data/")
        assert len(address.removeprefix(f"{NS}data/").split("/")) == 2
    assert second < first  # newest slice lists first (seed 002)
    assert first.split("/")[-2] == slice_id(T0)
    assert slice_id(T0 + 3600) < slice_id(T0) < slice_id(T0 - 3600)


# --- writes, overwrites, deletes, copies -------------------------------------------------------


def test_write_is_issue_then_link() -> None:
    model, _ = new_model()
    out = model.write("repo", "main", "a", 10)
    issued, written = out
    assert isinstance(issued, ev.AddressIssued) and isinstance(written, ev.ObjectWritten)
    assert issued.address == written.address == out.address
    assert issued.ttl_seconds == TTL
    assert written.ref_id == out.ref_id and written.size == 10 and written.path == "a"
    assert written.staging_token == model.branch("repo", "main").staging_token
    assert written.replaces_ref_id is None and written.replaces_address is None
    assert [u.address for u in out.uploads] == [out.address]
    assert model.objects[out.address].kind is ObjectKind.UPLOADED


def test_overwrite_in_the_same_token_replaces_exactly_the_old_reference() -> None:
    model, _ = new_model()
    first = model.write("repo", "main", "a", 10)
    model.write("repo", "main", "other", 10)  # an unrelated reference in the same token
    second = model.overwrite("repo", "main", "a", 20)
    written = only(second, ev.ObjectWritten)
    assert written.replaces_ref_id == first.ref_id
    assert written.replaces_address == first.address
    assert written.ref_id != first.ref_id
    # The issued token still protects the replaced address for its TTL; then it is garbage.
    assert model.truth().category(address_of(first)) is Category.ISSUED_UNEXPIRED
    truth = model.truth(now=T0 + TTL)
    assert first.address in truth.online_garbage
    assert second.address in truth.staged_live
    assert model.lookup("repo", "main", "a") == Entry(second.address, 20, written.ref_id)


def test_overwrite_after_commit_or_seal_replaces_nothing() -> None:
    model, _ = new_model()
    committed = model.write("repo", "main", "a", 10)
    model.commit("repo", "main")
    after_commit = only(model.overwrite("repo", "main", "a", 20), ev.ObjectWritten)
    assert after_commit.replaces_ref_id is None and after_commit.replaces_address is None
    model.seal("repo", "main")  # the open token (holding the overwrite) is now sealed
    after_seal = only(model.overwrite("repo", "main", "a", 30), ev.ObjectWritten)
    assert after_seal.replaces_ref_id is None
    truth = model.truth()
    assert committed.address in truth.committed
    assert {after_commit.address, after_seal.address} <= truth.staged_live


def test_overwrite_of_a_missing_path_is_refused() -> None:
    model, _ = new_model()
    with pytest.raises(ModelError):
        model.overwrite("repo", "main", "nope", 1)


def test_delete_of_a_staged_entry_names_its_reference() -> None:
    model, clock = new_model()
    written = model.write("repo", "main", "a", 10)
    clock.advance(5)
    deleted = only(model.delete("repo", "main", "a"), ev.ObjectDeleted)
    assert (deleted.ref_id, deleted.address, deleted.path) == (written.ref_id, written.address,
                                                               "a")
    assert model.lookup("repo", "main", "a") is None
    assert model.truth(now=T0 + 10).category(address_of(written)) is Category.ISSUED_UNEXPIRED
    truth = model.truth(now=T0 + TTL)
    assert written.address in truth.online_garbage
    # Garbage since the later of the delete and the issued token's expiry.
    assert truth.garbage_since[written.address] == T0 + TTL
    early = model.truth(now=T0 + 10, issued_ttl_respected=False)
    assert early.garbage_since[written.address] == T0 + 5
    with pytest.raises(ModelError):
        model.delete("repo", "main", "a")


def test_delete_of_a_committed_path_stages_a_tombstone_and_publishes_nothing() -> None:
    model, _ = new_model()
    written = model.write("repo", "main", "a", 10)
    model.commit("repo", "main")
    assert len(model.delete("repo", "main", "a")) == 0
    assert model.lookup("repo", "main", "a") is None
    assert model.branch_entries("repo", "main") == {}
    # Staged over the committed entry, then deleted: the staged reference ends (event) and a
    # tombstone still hides the committed entry.
    again = model.write("repo", "main", "a", 11)
    deleted = only(model.delete("repo", "main", "a"), ev.ObjectDeleted)
    assert deleted.ref_id == again.ref_id
    assert model.lookup("repo", "main", "a") is None
    commit = only(model.commit("repo", "main"), ev.CommitCreated)
    assert "a" not in model.commits[commit.commit_id].entries
    assert written.address in model.truth().committed  # the old commit still has it


def test_copy_within_and_across_branches_adds_references_to_the_same_address() -> None:
    model, clock = new_model()
    src = model.write("repo", "main", "a", 10)
    clock.advance(1)
    within = only(model.copy("repo", "main", "a", "main", "b"), ev.ObjectCopied)
    across = only(model.copy("repo", "main", "a", "dev", "c"), ev.ObjectCopied)
    assert within.address == across.address == src.address
    assert len({src.ref_id, within.ref_id, across.ref_id}) == 3
    assert (across.branch, across.path) == ("dev", "c")
    assert across.staging_token == model.branch("repo", "dev").staging_token
    assert within.source_read_at == T0 + 1
    # Copy over a path staged in the destination's open token replaces it.
    other = model.write("repo", "dev", "d", 5)
    over = only(model.copy("repo", "main", "a", "dev", "d"), ev.ObjectCopied)
    assert (over.replaces_ref_id, over.replaces_address) == (other.ref_id, other.address)
    # The source branch drops its token: the address lives on through dev's copy.
    model.reset_branch("repo", "main")
    truth = model.truth(now=T0 + 2 * TTL)
    assert src.address in truth.staged_live
    assert other.address in truth.online_garbage
    with pytest.raises(ModelError):
        model.copy("repo", "main", "a", "dev", "e")  # gone from main


# --- commits, merges, resets, tags -------------------------------------------------------------


def test_commit_seals_commits_and_opens_a_new_token() -> None:
    model, _ = new_model()
    a = model.write("repo", "main", "a", 10)
    token1 = model.branch("repo", "main").staging_token
    model.seal("repo", "main")
    token2 = model.branch("repo", "main").staging_token
    b = model.write("repo", "main", "b", 20)
    assert model.tokens[token1].state is TokenState.SEALED
    assert a.address in model.truth().staged_live  # sealed tokens keep their references live
    out = model.commit("repo", "main", at=T0 - 86400)
    created = only(out, ev.CommitCreated)
    branch = model.branch("repo", "main")
    assert created.sealed_tokens == [token1, token2]
    assert created.staging_token == branch.staging_token not in (token1, token2)
    assert created.parents == [] and created.committed_at == T0 - 86400
    assert created.manifest == f"{NS}_hardelete/manifests/{created.commit_id}.parquet"
    assert branch.head == created.commit_id and branch.sealed_tokens == []
    commit = model.commits[created.commit_id]
    assert out.commit is commit and commit.time == T0 - 86400
    assert {p: e.address for p, e in commit.entries.items()} == {"a": a.address,
                                                                 "b": b.address}
    assert {model.tokens[t].state for t in (token1, token2)} == {TokenState.COMMITTED}
    second = only(model.commit("repo", "main"), ev.CommitCreated)
    assert second.parents == [created.commit_id] and second.sealed_tokens == [
        created.staging_token]
    assert model.commits[second.commit_id].entries == commit.entries


def test_shadowed_sealed_entry_is_superseded_not_online_garbage() -> None:
    model, _ = new_model()
    sealed = model.write("repo", "main", "a", 10)
    model.seal("repo", "main")
    newer = model.overwrite("repo", "main", "a", 20)  # other token: replaces nothing
    model.commit("repo", "main")
    truth = model.truth()
    assert newer.address in truth.committed
    # The tracker counts the sealed token's live reference committed; only the reconciler
    # may reclaim it.
    assert sealed.address in truth.superseded
    assert sealed.address not in truth.online_garbage
    assert sealed.address not in model.reconciler_garbage(model.commits)  # token unexpired
    assert sealed.address in model.reconciler_garbage(model.commits, now=T0 + TTL)


def test_merge_three_way_source_wins_and_dest_staged_changes_are_committed() -> None:
    model, _ = new_model()
    model.write("repo", "main", "keep", 1)
    model.write("repo", "main", "gone", 1)
    model.write("repo", "main", "both", 1)
    base = only(model.commit("repo", "main"), ev.CommitCreated).commit_id
    model.create_branch("repo", "feature", "main")
    theirs = model.overwrite("repo", "feature", "both", 2)
    model.delete("repo", "feature", "gone")
    new = model.write("repo", "feature", "new", 2)
    feature_head = only(model.commit("repo", "feature"), ev.CommitCreated).commit_id
    ours = model.overwrite("repo", "main", "both", 3)  # conflict: source wins
    mine = model.write("repo", "main", "mine", 3)  # dest staged change: committed by merge
    open_token = model.branch("repo", "main").staging_token
    merged = only(model.merge("repo", "feature", "main"), ev.CommitCreated)
    assert merged.branch == "main" and merged.parents == [base, feature_head]
    assert merged.sealed_tokens == [open_token]
    entries = {p: e.address for p, e in model.commits[merged.commit_id].entries.items()}
    assert entries == {
        "keep": model.commits[base].entries["keep"].address,
        "both": theirs.address, "new": new.address, "mine": mine.address,
    }
    truth = model.truth()
    assert ours.address in truth.superseded  # lost the conflict, its token was committed
    with pytest.raises(ModelError):
        model.merge("repo", "main", "main")
    model.create_branch("repo", "empty", "main")
    model.reset_branch("repo", "empty")
    with pytest.raises(ModelError, match="nothing committed"):
        model.merge("repo", "dev", "main")  # dev never committed


def test_reset_and_delete_branch_drop_tokens_and_end_references() -> None:
    model, clock = new_model()
    staged = model.write("repo", "dev", "a", 1)
    model.seal("repo", "dev")
    staged2 = model.write("repo", "dev", "b", 1)
    tokens = [*model.branch("repo", "dev").sealed_tokens,
              model.branch("repo", "dev").staging_token]
    clock.advance(TTL * 2)
    reset = only(model.reset_branch("repo", "dev"), ev.BranchReset)
    assert reset.dropped_tokens == tokens and reset.head is None
    assert {model.tokens[t].state for t in tokens} == {TokenState.DROPPED}
    truth = model.truth()
    assert {staged.address, staged2.address} <= truth.online_garbage
    assert truth.garbage_since[address_of(staged)] == T0 + TTL * 2  # the reset, after expiry
    kept = model.write("repo", "dev", "c", 1)
    model.commit("repo", "dev")
    dropped = model.write("repo", "dev", "d", 1)
    deleted = only(model.delete_branch("repo", "dev"), ev.BranchDeleted)
    assert deleted.last_head == model.commits[deleted.last_head or ""].id
    truth = model.truth()
    assert kept.address in truth.committed  # commits outlive their branch
    assert dropped.address not in truth.staged_live
    with pytest.raises(ModelError, match="default branch"):
        model.delete_branch("repo", "main")
    with pytest.raises(ModelError):
        model.write("repo", "dev", "x", 1)


def test_branch_from_commit_or_tag_and_tags() -> None:
    model, _ = new_model()
    model.write("repo", "main", "a", 1)
    cid = only(model.commit("repo", "main"), ev.CommitCreated).commit_id
    tag = only(model.create_tag("repo", "v1", "main"), ev.TagCreated)
    assert tag.commit_id == cid
    assert only(model.create_branch("repo", "from-tag", "v1"),
                ev.BranchCreated).source_commit == cid
    assert only(model.create_branch("repo", "from-commit", cid),
                ev.BranchCreated).source_commit == cid
    assert model.lookup("repo", "from-tag", "a") is not None
    with pytest.raises(ModelError):
        model.create_tag("repo", "v1", cid)
    with pytest.raises(ModelError, match="no commit"):
        model.create_tag("repo", "v0", "dev")
    with pytest.raises(ModelError):
        model.create_branch("repo", "x", "nope")
    assert only(model.delete_tag("repo", "v1"), ev.TagDeleted).tag == "v1"
    with pytest.raises(ModelError):
        model.delete_tag("repo", "v1")


# --- upload tokens, unlinked uploads, leaks ----------------------------------------------------


def test_link_verifies_the_token_and_is_single_use() -> None:
    model, clock = new_model()
    issued = model.issue_address("repo")
    other = model.issue_address("repo")
    assert issued.address and issued.signed_token and other.address and other.signed_token
    with pytest.raises(ModelError, match="nothing was uploaded"):
        model.link("repo", "main", "a", issued.address, issued.signed_token)
    model.upload("repo", issued.address, 5)
    with pytest.raises(ModelError, match="issued for"):
        model.link("repo", "main", "a", issued.address, other.signed_token)
    with pytest.raises(ModelError, match="signature"):
        model.link("repo", "main", "a", issued.address, issued.signed_token[:-2] + "xx")
    linked = only(model.link("repo", "main", "a", issued.address, issued.signed_token),
                  ev.ObjectWritten)
    assert linked.size == 5
    with pytest.raises(ModelError, match="already used"):
        model.link("repo", "main", "b", issued.address, issued.signed_token)
    model.upload("repo", other.address, 1)
    clock.advance(TTL)
    with pytest.raises(ModelError, match="expired"):
        model.link("repo", "main", "b", other.address, other.signed_token)
    with pytest.raises(ModelError, match="never reused"):
        model.upload("repo", other.address, 1)


def test_unlinked_upload_is_protected_until_its_token_expires() -> None:
    model, _ = new_model()
    out = model.unlinked_upload("repo", 10)
    assert [type(e) for e in out] == [ev.AddressIssued]
    assert out.address
    assert model.truth(now=T0 + TTL - 1).category(out.address) is Category.ISSUED_UNEXPIRED
    later = model.truth(now=T0 + TTL)
    assert later.category(out.address) is Category.ONLINE_GARBAGE
    assert later.garbage_since[out.address] == T0 + TTL
    assert later.due(grace_seconds=1) == frozenset()
    assert model.truth(now=T0 + TTL + 1).due(grace_seconds=1) == {out.address}
    ignoring = model.truth(now=T0 + 1, issued_ttl_respected=False)
    assert ignoring.garbage_since[out.address] == T0
    assert ignoring.issued_unexpired == frozenset()


def test_leak_writes_bytes_without_any_event() -> None:
    model, _ = new_model()
    before = len(model.events)
    out = model.leak("repo", 10)
    assert len(out) == 0 and len(model.events) == before
    assert out.address and out.address.startswith(f"{NS}data/")
    truth = model.truth()
    assert truth.category(out.address) is Category.LEAKED
    assert out.address in truth.objects
    assert out.address in model.reconciler_garbage([])


def test_reconciler_garbage_keeps_retained_commits_live_staging_and_issued() -> None:
    model, clock = new_model()
    old = model.write("repo", "main", "a", 1)
    first = only(model.commit("repo", "main"), ev.CommitCreated).commit_id
    new = model.overwrite("repo", "main", "a", 1)
    second = only(model.commit("repo", "main"), ev.CommitCreated).commit_id
    copied = model.copy("repo", "main", "a", "dev", "a")  # live staged copy of a committed one
    leaked = model.leak("repo", 1).address
    unlinked = model.unlinked_upload("repo", 1).address
    gone = model.write("repo", "dev", "g", 1)
    model.delete("repo", "dev", "g")
    # While their upload tokens are valid, unlinked and deleted addresses are protected.
    assert model.reconciler_garbage([first, second]) == {leaked}
    clock.advance(TTL)
    everything = model.reconciler_garbage([first, second])
    assert everything == {leaked, gone.address, unlinked}
    assert model.reconciler_garbage([second]) == everything | {old.address}
    assert copied.address == new.address
    assert new.address not in model.reconciler_garbage([])  # the staged copy keeps it
    assert old.address in model.reconciler_garbage([])
    assert model.reconciler_garbage([first, second], repository="other") == frozenset()


def test_operations_on_unknown_things_are_refused() -> None:
    model, _ = new_model()
    refused: list[Callable[[], object]] = [
        lambda: model.write("nope", "main", "a", 1),
        lambda: model.write("repo", "nope", "a", 1),
        lambda: model.write("repo", "main", "", 1),
        lambda: model.write("repo", "main", "a", -1),
        lambda: model.delete("repo", "main", "a"),
        lambda: model.commit("repo", "nope"),
        lambda: model.create_branch("repo", "dev"),
        lambda: model.create_branch("repo", "bad name"),
        lambda: model.issue_address("repo", ttl_seconds=0),
    ]
    for call in refused:
        before = (len(model.events), len(model.objects), len(model.issued))
        with pytest.raises(ModelError):
            call()
        assert (len(model.events), len(model.objects), len(model.issued)) == before


# --- workloads ---------------------------------------------------------------------------------


def test_workload_is_deterministic_for_a_seed() -> None:
    def ops(seed: int) -> list[Any]:
        model = Model(clock=ManualClock(T0, 1.0), new_id=seeded_ids(99))
        out = []
        for op in Workload(seed, 150).operations(model):
            apply_op(model, op)
            out.append(op)
        return out

    assert ops(5) == ops(5)
    assert ops(5) != ops(6)


@pytest.mark.parametrize("stripes", [1, 4])
def test_with_an_outbox_every_event_is_numbered_gaplessly_per_domain(tmp_path: Any,
                                                                     stripes: int) -> None:
    from schemas.outbox import Outbox

    with Outbox(tmp_path / "service.db", synchronous="OFF") as outbox:
        model = Model(clock=ManualClock(T0, 1.0), new_id=seeded_ids(7), outbox=outbox)
        wl = Workload(3, 200, repos=2)
        for repo in wl.repo_ids():
            model.create_repository(repo, wl.namespace(repo), stripes=stripes)
        run_workload(model, wl)
        events = model.events
        per_domain: dict[tuple[str, int], list[int]] = {}
        for e in events:
            assert isinstance(e, ev.ServiceEvent) and e.incarnation == outbox.incarnation
            assert e.seq is not None
            per_domain.setdefault((e.repository, e.stripe), []).append(e.seq)
        assert all(seqs == list(range(1, len(seqs) + 1)) for seqs in per_domain.values())
        assert len(per_domain) == 2 * stripes  # every stripe is used
        # the outbox holds exactly these events, as published
        assert [ev.decode(r.value) for r in outbox.unpublished(limit=10_000)] == model.events
    plain = Model(clock=ManualClock(T0, 1.0), new_id=seeded_ids(7))
    run_workload(plain, wl)
    assert all(getattr(e, "seq", None) is None for e in plain.events)  # unchanged without one


def test_workload_mix_is_respected_and_validated() -> None:
    only_writes = {k.value: 0.0 for k in DEFAULT_MIX} | {"write": 1.0}
    model = Model(clock=ManualClock(T0))
    wl = Workload(1, 30, only_writes, repos=2, branches=2)
    kinds = Counter(op.kind for op in _run(model, wl))
    assert kinds == {OpKind.WRITE: 30, OpKind.CREATE_REPOSITORY: 2, OpKind.CREATE_BRANCH: 2}
    assert sorted(model.repositories) == wl.repo_ids()
    with pytest.raises(ValueError, match="unknown op kind"):
        Workload(1, 10, {"explode": 1.0})
    with pytest.raises(ValueError, match="positive total"):
        Workload(1, 10, {k.value: 0.0 for k in DEFAULT_MIX})
    with pytest.raises(ValueError, match="unknown op kind"):
        Workload(1, 10, {"create_repository": 1.0})
    with pytest.raises(ValueError):
        Workload(1, 10, {"write": -1.0})


def test_workload_span_back_dates_commits_in_order() -> None:
    clock = ManualClock(T0, 1.0)
    model = Model(clock=clock)
    run_workload(model, Workload(3, 200, {"commit": 30}, span_days=10))
    times = [model.commits[c].time for c in model.repository("wl-r0").commit_ids]
    assert len(times) > 20
    assert times == sorted(times)
    assert times[0] < T0 - 8 * 86400 and times[-1] <= T0


def _run(model: Model, workload: Workload) -> list[Any]:
    ops = []
    for op in workload.operations(model):
        apply_op(model, op)
        ops.append(op)
    return ops


# --- property tests: invariants of the ground truth over random workloads ----------------------


@dataclass
class Fold:
    """What a tracker can know from the events alone (an observed-remove set per address and
    token states that only move up): an oracle independent of the model's own bookkeeping."""

    added: dict[str, tuple[str, str]] = field(default_factory=dict)  # ref -> (address, token)
    removed: set[str] = field(default_factory=set)
    committed_tokens: set[str] = field(default_factory=set)
    dropped_tokens: set[str] = field(default_factory=set)
    issued: set[str] = field(default_factory=set)

    def apply(self, e: ev.Event) -> None:
        if isinstance(e, ev.ObjectWritten | ev.ObjectCopied):
            assert e.ref_id not in self.added, "reference id reused"
            self.added[e.ref_id] = (e.address, e.staging_token)
            if e.replaces_ref_id is not None:
                # Only a reference of the SAME token may be replaced, and only once.
                assert self.added[e.replaces_ref_id] == (e.replaces_address, e.staging_token)
                assert e.replaces_ref_id not in self.removed
                self.removed.add(e.replaces_ref_id)
        elif isinstance(e, ev.ObjectDeleted):
            assert self.added[e.ref_id] == (e.address, e.staging_token)
            assert e.ref_id not in self.removed
            self.removed.add(e.ref_id)
        elif isinstance(e, ev.CommitCreated):
            self.committed_tokens.update(e.sealed_tokens)
        elif isinstance(e, ev.BranchReset | ev.BranchDeleted):
            self.dropped_tokens.update(e.dropped_tokens)
        elif isinstance(e, ev.AddressIssued):
            self.issued.add(e.address)

    def live(self) -> set[str]:
        return {a for r, (a, t) in self.added.items() if r not in self.removed
                and t not in self.committed_tokens and t not in self.dropped_tokens}

    def committed(self) -> set[str]:
        return {a for r, (a, t) in self.added.items()
                if r not in self.removed and t in self.committed_tokens}


mixes = st.dictionaries(st.sampled_from([k.value for k in DEFAULT_MIX]),
                        st.integers(min_value=0, max_value=10).map(float), max_size=8)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**32), ops=st.integers(0, 150), mix=mixes,
       repos=st.integers(1, 2), branches=st.integers(1, 4), paths=st.integers(1, 12),
       step=st.sampled_from([0.0, 1.0, 50.0]))
def test_ground_truth_invariants(seed: int, ops: int, mix: dict[str, float], repos: int,
                                 branches: int, paths: int, step: float) -> None:
    assume(sum(mix.get(k.value, w) for k, w in DEFAULT_MIX.items()) > 0)
    clock = ManualClock(T0, step)
    model = Model(clock=clock, upload_ttl_seconds=TTL, new_id=seeded_ids(seed))
    events = run_workload(model, Workload(seed, ops, mix, repos=repos, branches=branches,
                                          paths=paths))
    assert events == model.events
    truth = model.truth()

    # The categories partition the known addresses.
    parts = truth.partition()
    assert sum(len(p) for p in parts.values()) == len(truth.known)
    assert truth.objects <= truth.known
    assert set(truth.garbage_since) == truth.online_garbage

    # Independent, structural views of the state.
    staged_now = {
        v.address
        for r in model.repositories.values() for b in r.branches.values()
        for t in [*b.sealed_tokens, b.staging_token]
        for v in model.tokens[t].entries.values() if isinstance(v, Entry)
    }
    committed_now = {e.address for c in model.commits.values() for e in c.entries.values()}
    assert staged_now == truth.live_referenced
    assert not staged_now & truth.online_garbage
    assert not committed_now & truth.online_garbage
    assert committed_now == truth.committed
    for branch_entries in (model.branch_entries(r.id, b) for r in model.repositories.values()
                           for b in r.branches):
        assert not {e.address for e in branch_entries.values()} & truth.online_garbage

    # The events alone carry the truth (what the tracker relies on).
    fold = Fold()
    for e in events:
        fold.apply(e)
    assert fold.committed() == truth.committed | truth.superseded
    assert fold.live() - fold.committed() == truth.staged_live
    assert fold.issued == set(model.issued)
    ref_ids = [e.ref_id for e in events if isinstance(e, ev.ObjectWritten | ev.ObjectCopied)]
    assert len(ref_ids) == len(set(ref_ids)) == len(model.references)

    # Every event is valid under the contract and inside its repository's namespace.
    for e in events:
        assert ev.decode(ev.encode(e)) == e
        ns = model.repositories[e.repository].storage_namespace
        for name in ("address", "replaces_address"):
            value = getattr(e, name, None)
            assert value is None or value.startswith(ns + "data/")

    # Garbage times are real: never before the address was issued, never in the future.
    for address, since in truth.garbage_since.items():
        assert model.issued[address].issued_at <= since
    # Without the issued protection, only more (never less) is garbage.
    loose = model.truth(now=truth.now, issued_ttl_respected=False)
    assert truth.online_garbage <= loose.online_garbage
    # Retaining every commit, the reconciler deletes exactly the unprotected objects; a
    # superseded address may still be protected by a live copy or its upload token.
    issued_live = {a for a, i in model.issued.items() if i.expires_at > truth.now}
    assert model.reconciler_garbage(model.commits, now=truth.now) == truth.objects & (
        truth.online_garbage | truth.leaked
        | (truth.superseded - truth.live_referenced - issued_live))


# --- the service layer on real servers --------------------------------------------------------








def test_the_services_uncommitted_list_and_the_grace_rule_of_the_garbage_oracle() -> None:
    from sim.model import ManualClock, Model

    clock = ManualClock(start=1_000.0, step=1.0)
    m = Model(clock=clock, upload_ttl_seconds=100)
    m.create_repository("r", "s3://b/r/")
    staged = m.write("r", "main", "a", 1).address
    committed = m.write("r", "main", "c", 1).address
    m.commit("r", "main")
    m.seal("r", "main")  # a sealed token's entries are still uncommitted
    sealed = m.write("r", "main", "s", 1).address
    m.seal("r", "main")
    pending = m.unlinked_upload("r", 1).address
    leak = m.leak("r", 1).address
    gone = m.write("r", "main", "g", 1).address
    m.delete("r", "main", "g")
    ended = clock.now
    uncommitted = m.uncommitted_addresses("r")
    assert {sealed, pending} <= uncommitted
    # every unexpired upload ticket is listed, linked or not: it protects its address until
    # it expires, whatever became of the references (the truth's issued_unexpired)
    assert {staged, committed, gone} <= uncommitted and leak not in uncommitted
    expired = m.uncommitted_addresses("r", now=clock.now + 1_000)  # every ticket expired
    assert sealed in expired  # its token is still sealed
    assert staged not in expired and committed not in expired  # committed since
    assert pending not in expired and gone not in expired and leak not in expired
    # grace: an address unreferenced less than grace before the horizon is not garbage
    later = ended + 1_000  # every upload expired
    assert gone not in m.reconciler_garbage([], repository="r", now=later,
                                            grace_seconds=3_600, horizon=later)
    assert gone in m.reconciler_garbage([], repository="r", now=later, grace_seconds=10,
                                        horizon=later)
    assert leak in m.reconciler_garbage([], repository="r", now=later, grace_seconds=3_600,
                                        horizon=later)


def _naive_merge_base(commits: dict[str, Any], a: str, b: str) -> str | None:
    ancestors: set[str] = set()
    stack = [a]
    while stack:
        c = stack.pop()
        if c not in ancestors:
            ancestors.add(c)
            stack.extend(commits[c].parents)
    seen: set[str] = set()
    frontier = [b]
    while frontier:
        nxt: list[str] = []
        for cid in frontier:
            if cid in ancestors:
                return cid
            if cid not in seen:
                seen.add(cid)
                nxt.extend(commits[cid].parents)
        frontier = nxt
    return None


@settings(max_examples=200, deadline=None)
@given(st.lists(st.lists(st.integers(min_value=0, max_value=10_000), max_size=3), max_size=40),
       st.integers(min_value=0), st.integers(min_value=0))
def test_merge_base_walks_only_as_deep_as_needed_and_agrees_with_the_whole_walk(
        parent_picks: list[list[int]], ia: int, ib: int) -> None:
    """The bounded merge base (generation-ordered walk of a's ancestry) is the one a walk of
    a's whole history gives, on any commit graph."""
    from sim.model import Commit

    m = Model()
    ids: list[str] = []
    for i, picks in enumerate(parent_picks):
        parents = tuple(dict.fromkeys(ids[p % len(ids)] for p in picks)) if ids else ()
        cid = f"c{i}"
        m.commits[cid] = Commit(cid, "r", "main", parents, 0.0, "", {}, ())
        ids.append(cid)
    assume(ids)
    a, b = ids[ia % len(ids)], ids[ib % len(ids)]
    assert m._merge_base(a, b) == _naive_merge_base(m.commits, a, b)
