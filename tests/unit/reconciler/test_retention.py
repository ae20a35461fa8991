"""Tests for reconciler.retention: lakeFS committed retention (#1932) and Icechunk
"update A in place" snapshot expiration. Pure, no servers."""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from reconciler.committed import plan_retention
from reconciler.retention import (
    FrozenMap,
    RetentionPolicy,
    active_commits,
    delete_expired_refs,
    expire_ref,
    expire_snapshots,
    reachable,
    refs_to_delete,
    retained_commits,
)
from reconciler.s3io import Namespace
from reconciler.state import CommittedState
from schemas.records import CommitRecord, RecordError
from sim.retention_examples import (
    BRANCHES_001,
    G001,
    ORDER_001,
    PARENTS_001,
    TAGS_001,
    THRESHOLD_001,
)

DAY = 86400.0
NOW = 1_700_000_000.0


def ago(days: float) -> float:
    return NOW - days * DAY


def graph(*commits: tuple[str, CommitRecord]) -> dict[str, CommitRecord]:
    return dict(commits)


def C(cid: str, parents: tuple[str, ...] | str = (),
      days_ago: float = 0.0) -> tuple[str, CommitRecord]:
    ps = (parents,) if isinstance(parents, str) else parents
    return cid, CommitRecord(ps, ago(days_ago))


def objects_of(active: frozenset[str], manifests: Mapping[str, frozenset[str]]) -> set[str]:
    """Objects retained = union of the manifests (full trees) of the active commits."""
    return set().union(*(manifests[c] for c in active if c in manifests))


# ---------------------------------------------------------------- seed 003 (lakeFS #1932)
#
# The images are missing; the graphs below are reconstructed from the text.
#
# Simple example (main, 7 days). "7 days ago the HEAD pointed to B": B is the newest commit
# older than 7 days. example1/example2 are in B's tree, example3 was deleted at B:
#   A (20d) add example1, example3 -> B (10d) del example3, add example2
#   -> C (4d) del example1 -> D (1d, HEAD) del example2
SIMPLE = graph(C("A", (), 20), C("B", "A", 10), C("C", "B", 4), C("D", "C", 1))
SIMPLE_TREES = {
    "A": frozenset({"example1", "example3"}),
    "B": frozenset({"example1", "example2"}),
    "C": frozenset({"example2"}),
    "D": frozenset(),
}


def test_seed003_simple_example() -> None:
    policy = RetentionPolicy(default_days=7)
    active = active_commits(SIMPLE, {"main": "D"}, {}, policy, NOW)
    assert active == {"B", "C", "D"}
    kept = objects_of(active, SIMPLE_TREES)
    assert {"example1", "example2"} <= kept
    assert "example3" not in kept


# Complex example (main 7 days, feature1 3 days). "On each branch we create a new file and
# delete it in a subsequent commit; we also delete example1 on main": main creates example2,
# feature1 creates example3, main deletes example1 before its retention window. B is main's
# HEAD 7 days ago, D is feature1's HEAD 3 days ago; the dangling example below requires
# C older than 7 days and D between 7 and 3 days old.
#   main:     M (20d) add example1 -> A (14d) add example2 -> B (9d) del example1
#             -> E (2d, HEAD) del example2
#   feature1: branched at M -> C (12d) add example3 -> D (5d, HEAD) del example3
COMPLEX = graph(
    C("M", (), 20),
    C("A", "M", 14),
    C("B", "A", 9),
    C("E", "B", 2),
    C("C", "M", 12),
    C("D", "C", 5),
)
COMPLEX_TREES = {
    "M": frozenset({"example1"}),
    "A": frozenset({"example1", "example2"}),
    "B": frozenset({"example2"}),
    "E": frozenset(),
    "C": frozenset({"example1", "example3"}),
    "D": frozenset({"example1"}),
}
COMPLEX_POLICY = RetentionPolicy(default_days=7, branch_days={"main": 7, "feature1": 3})


def test_seed003_complex_example() -> None:
    heads = {"main": "E", "feature1": "D"}
    active = active_commits(COMPLEX, heads, {}, COMPLEX_POLICY, NOW)
    assert active == {"E", "B", "D"}
    kept = objects_of(active, COMPLEX_TREES)
    assert "example2" in kept  # accessible from B
    assert "example3" not in kept  # not accessible from B, D or their descendants
    assert "example1" in kept  # accessible from D, though deleted on main long ago


@pytest.mark.parametrize(("default_days", "feature_active"), [(7, {"C", "D"}), (3, set())])
def test_seed003_dangling_example(default_days: float, feature_active: set[str]) -> None:
    # feature1 was deleted: D (and C) are dangling; D gets a dummy child dated like D.
    policy = RetentionPolicy(default_days=default_days, branch_days={"main": 7})
    active = active_commits(COMPLEX, {"main": "E"}, {}, policy, NOW)
    assert active == {"E", "B"} | feature_active
    assert ("example3" in objects_of(active, COMPLEX_TREES)) == (default_days == 7)


def test_branch_deletion_makes_head_dangling() -> None:
    policy = RetentionPolicy(default_days=1, branch_days={"feature1": 30})
    both = active_commits(COMPLEX, {"main": "E", "feature1": "D"}, {}, policy, NOW)
    assert {"C", "D", "M"} <= both  # 30 days on feature1 reaches back to its root
    deleted = active_commits(COMPLEX, {"main": "E"}, {}, policy, NOW)
    assert deleted & {"C", "D"} == set()  # default 1 day: dummy HEAD predates the window


def test_head_always_active_even_if_old_or_missing() -> None:
    g = graph(C("a", (), 40), C("b", "a", 30))
    policy = RetentionPolicy(default_days=1)
    assert active_commits(g, {"main": "b"}, {}, policy, NOW) == {"b"}
    assert active_commits(g, {"main": "ghost"}, {}, policy, NOW) == {"ghost"}


def test_missing_parent_ends_walk_and_is_active() -> None:
    g = graph(C("b", "gone", 1), C("c", "b", 0))
    policy = RetentionPolicy(default_days=7)
    assert active_commits(g, {"main": "c"}, {}, policy, NOW) == {"c", "b", "gone"}
    assert reachable(g, ["c"]) == {"c", "b", "gone"}


def test_tags_retain_only_their_commit() -> None:
    g = graph(C("a", (), 40), C("b", "a", 30), C("c", "b", 20), C("d", "c", 0))
    policy = RetentionPolicy(default_days=7)
    assert active_commits(g, {"main": "d"}, {}, policy, NOW) == {"d", "c"}
    assert active_commits(g, {"main": "d"}, {"v1": "a"}, policy, NOW) == {"d", "c", "a"}


def test_merge_second_parent_is_not_main_ancestry() -> None:
    # main: a -> b -> m (merge of f2); feature branch f1 -> f2 was deleted after the merge.
    g = graph(
        C("a", (), 30),
        C("b", "a", 20),
        C("f1", "a", 10),
        C("f2", "f1", 6),
        C("m", ("b", "f2"), 1),
    )
    long_main = RetentionPolicy(default_days=3, branch_days={"main": 100})
    assert active_commits(g, {"main": "m"}, {}, long_main, NOW) == {"m", "b", "a"}
    # f2 is a dangling tip (nobody's first parent): default retention via a dummy HEAD.
    wide_default = RetentionPolicy(default_days=8, branch_days={"main": 100})
    assert active_commits(g, {"main": "m"}, {}, wide_default, NOW) == {"m", "b", "a", "f2", "f1"}
    assert reachable(g, ["m"]) == set(g)


def test_policy_is_hashable_and_validated() -> None:
    p = RetentionPolicy(7, {"main": 30})
    assert hash(p) == hash(RetentionPolicy(7, {"main": 30}))
    assert p.days_for("main") == 30 and p.days_for("other") == 7
    assert isinstance(p.branch_days, FrozenMap)
    with pytest.raises(ValueError):
        RetentionPolicy(-1)
    with pytest.raises(ValueError):
        RetentionPolicy(1, {"x": math.nan})


def test_a_commit_time_that_is_nan_is_refused() -> None:
    # (the retention input is the mirror's one commit record: its id is the key)
    with pytest.raises(RecordError, match="NaN"):
        CommitRecord(("a",), math.nan)


# ---------------------------------------------------------------- seed 001 (Icechunk)
# (the seed itself: sim/retention_examples.py)


def parents_of(g: Mapping[str, CommitRecord]) -> dict[str, tuple[str, ...]]:
    return {k: c.parents for k, c in g.items()}


def test_seed001_step_by_step() -> None:
    g: Mapping[str, CommitRecord] = G001
    expected = dict(PARENTS_001)
    branch_heads = list(BRANCHES_001.values())
    all_heads = branch_heads + list(TAGS_001.values())

    # main: 14 -> 13 -> 12 | 5 4 2 1 -> 0  =>  12's parent becomes 0
    g = expire_ref(g, BRANCHES_001["main"], THRESHOLD_001)
    expected["12"] = ("0",)
    assert parents_of(g) == expected
    # 4 and 5 are dangling for branches, but still held by tag2
    assert reachable(g, branch_heads) == set(G001) - {"4", "5"}
    assert reachable(g, all_heads) == set(G001)

    # develop: 11 -> 10 | 6 3 2 1 -> 0  => 10's parent becomes 0; nothing new dangles
    before = reachable(g, branch_heads)
    g = expire_ref(g, BRANCHES_001["develop"], THRESHOLD_001)
    expected["10"] = ("0",)
    assert parents_of(g) == expected
    assert reachable(g, branch_heads) == before

    # test: 9 | 7 6 3 2 1 -> 0  => 9's parent becomes 0
    g = expire_ref(g, BRANCHES_001["test"], THRESHOLD_001)
    expected["9"] = ("0",)
    assert parents_of(g) == expected

    # qa: 8 | 7 ... -> 0  => 8's parent becomes 0; now 6 and 7 are dangling
    g = expire_ref(g, BRANCHES_001["qa"], THRESHOLD_001)
    expected["8"] = ("0",)
    assert parents_of(g) == expected
    assert reachable(g, branch_heads) == {"0", "8", "9", "10", "11", "12", "13", "14"}
    assert set(G001) - reachable(g, all_heads) == {"6", "7"}

    # tags point at expired snapshots: nothing happens
    for tag in TAGS_001.values():
        assert expire_ref(g, tag, THRESHOLD_001) == g


@pytest.mark.parametrize("order", [ORDER_001, None, list(reversed(ORDER_001))])
def test_seed001_final_result(order: list[tuple[str, str]] | None) -> None:
    res = expire_snapshots(G001, BRANCHES_001, TAGS_001, THRESHOLD_001, order)
    assert parents_of(res.commits) == {
        **PARENTS_001,
        "8": ("0",),
        "9": ("0",),
        "10": ("0",),
        "12": ("0",),
    }
    assert res.edited == {"8", "9", "10", "12"}
    assert res.expired == {"6", "7"}  # GC can free two snapshots ...
    assert res.refs_pointing_to_expired == (("tag", "tag1"), ("tag", "tag2"))

    # ... and five more once the expired tags are deleted.
    branches, tags = delete_expired_refs(BRANCHES_001, TAGS_001, res)
    assert branches == BRANCHES_001 and tags == {}
    live = reachable(res.commits, [*branches.values(), *tags.values()])
    assert set(G001) - live - res.expired == {"1", "2", "3", "4", "5"}
    kept_tag1, _ = delete_expired_refs(BRANCHES_001, TAGS_001, res, delete_tags=False)
    assert kept_tag1 == BRANCHES_001
    assert delete_expired_refs(BRANCHES_001, TAGS_001, res, delete_tags=False)[1] == TAGS_001


def _freed(mode: str, delete_expired_tags: bool) -> set[str]:
    """Snapshots garbage collection may free after expiring the seed's history."""
    res = expire_snapshots(G001, BRANCHES_001, TAGS_001, THRESHOLD_001, ORDER_001, mode=mode)
    branches, tags = BRANCHES_001, TAGS_001
    if delete_expired_tags:
        branches, tags = delete_expired_refs(BRANCHES_001, TAGS_001, res, delete_branches=False)
    return set(G001) - reachable(res.commits, [*branches.values(), *tags.values()])


def test_seed001_three_outcomes() -> None:
    # The seed's sample run: tags keep their ancestry, only 6 and 7 are freed.
    assert _freed("seed", delete_expired_tags=False) == {"6", "7"}
    # Icechunk 1.1 re-parents every ref's snapshot, tags included: 1, 2, 4, 6, 7 are freed.
    assert _freed("icechunk", delete_expired_tags=False) == {"1", "2", "4", "6", "7"}
    # Deleting the tags that point at expired snapshots (delete-expired-tags): 1..7 freed.
    assert _freed("seed", delete_expired_tags=True) == {str(i) for i in range(1, 8)}
    assert _freed("icechunk", delete_expired_tags=True) == {str(i) for i in range(1, 8)}


@pytest.mark.parametrize("order", [ORDER_001, None, list(reversed(ORDER_001))])
def test_seed001_icechunk_reparents_tags(order: list[tuple[str, str]] | None) -> None:
    res = expire_snapshots(G001, BRANCHES_001, TAGS_001, THRESHOLD_001, order, mode="icechunk")
    assert parents_of(res.commits) == {
        **PARENTS_001, "3": ("0",), "5": ("0",), "8": ("0",), "9": ("0",), "10": ("0",),
        "12": ("0",)}
    assert res.expired == {"1", "2", "4", "6", "7"}
    # the tags still point at their (expired) snapshots, whose content is unchanged
    assert res.refs_pointing_to_expired == (("tag", "tag1"), ("tag", "tag2"))
    assert expire_ref(res.commits, "3", THRESHOLD_001, mode="icechunk") == res.commits


def test_seed001_modes_in_retained_commits() -> None:
    # Retention sees the rewritten history. Branches keep their whole (rewritten) ancestry;
    # dangling tips are walked with a default window that opens between snapshots 4 and 5.
    now = 1000.0 + 3600.0 * 15
    policy = RetentionPolicy(default_days=10.5 / 24,
                             branch_days={b: math.inf for b in BRANCHES_001})
    kept = {mode: retained_commits(G001, BRANCHES_001, TAGS_001, policy, now,
                                   expire_older_than=THRESHOLD_001, mode=mode)
            for mode in ("seed", "icechunk")}
    branch_side = {"0", "8", "9", "10", "11", "12", "13", "14"}
    # 7 -> 6 -> 3 is a young dangling tip in both readings (the window reaches 3)
    # seed: tag2's snapshot 5 keeps its parent 4 (the dangling walk from 5 reaches it)
    assert kept["seed"] == branch_side | {"3", "5", "6", "7", "4"}
    # icechunk: 5 was re-parented to 0, so 4 is an old dangling tip and goes
    assert kept["icechunk"] == branch_side | {"3", "5", "6", "7"}
    # once the service deleted the expired tags (the mirror no longer has them) ...
    res = expire_snapshots(G001, BRANCHES_001, TAGS_001, THRESHOLD_001, mode="icechunk")
    branches, tags = delete_expired_refs(BRANCHES_001, TAGS_001, res)
    assert (branches, tags) == (BRANCHES_001, {})
    dropped = retained_commits(G001, branches, tags, policy, now,
                               expire_older_than=THRESHOLD_001, mode="icechunk")
    # ... 5 (a young dangling tip) and 3 (on 7's chain) stay by the window. The reconciler
    # rewrites no history at the service (icechunk's re-parenting of 5 was this run's reading),
    # so with tag2 gone 5 is a dangling tip with its own parent 4 again: the window reaches 4
    # in both readings (before issue 33 the run dropped the live tags itself and freed 4).
    assert dropped == kept["seed"] == kept["icechunk"] | {"4"}
    with pytest.raises(ValueError, match="expiration mode"):
        expire_snapshots(G001, BRANCHES_001, TAGS_001, THRESHOLD_001,
                         mode="bogus")  # type: ignore[arg-type]


def test_seed001_never_edits_or_expires_ref_targets() -> None:
    res = expire_snapshots(G001, BRANCHES_001, TAGS_001, THRESHOLD_001)
    for target in [*BRANCHES_001.values(), *TAGS_001.values()]:
        assert target not in res.expired
    assert res.commits["3"] == G001["3"] and res.commits["5"] == G001["5"]


def test_branch_pointing_to_expired_snapshot_is_reported_not_edited() -> None:
    branches = {**BRANCHES_001, "old": "4"}
    res = expire_snapshots(G001, branches, TAGS_001, THRESHOLD_001)
    assert ("branch", "old") in res.refs_pointing_to_expired
    assert res.commits["4"] == G001["4"]
    b, _ = delete_expired_refs(branches, TAGS_001, res, delete_branches=False)
    assert "old" in b
    b, _ = delete_expired_refs(branches, TAGS_001, res)
    assert "old" not in b


def test_order_validation() -> None:
    with pytest.raises(ValueError):
        expire_snapshots(G001, BRANCHES_001, TAGS_001, THRESHOLD_001, [("branch", "nope")])
    with pytest.raises(ValueError):
        expire_snapshots(G001, BRANCHES_001, TAGS_001, THRESHOLD_001, [("tag", "main")])
    with pytest.raises(ValueError):
        expire_snapshots(
            G001, BRANCHES_001, TAGS_001, THRESHOLD_001, [("tag", "tag1"), ("tag", "tag1")]
        )


def test_partial_order_processes_only_listed_refs() -> None:
    res = expire_snapshots(G001, BRANCHES_001, TAGS_001, THRESHOLD_001, [("branch", "main")])
    assert res.edited == {"12"}
    assert res.expired == set()  # 4 and 5 are still held by tag2


def test_expiration_keeps_merge_parents() -> None:
    # main: r -> x1 -> x2 -> a(merge of s) -> n ; s is recent, on a side branch from r
    g = graph(
        C("r", (), 30),
        C("x1", "r", 20),
        C("x2", "x1", 15),
        C("s", "r", 2),
        C("a", ("x2", "s"), 1),
        C("n", "a", 0),
    )
    res = expire_snapshots(g, {"main": "n"}, {}, ago(10))
    assert res.commits["a"].parents == ("r", "s")
    assert res.expired == {"x1", "x2"}


def test_expiration_missing_parent_acts_as_end_of_chain() -> None:
    g = graph(C("x", "gone", 20), C("y", "x", 15), C("n", "y", 1))
    res = expire_snapshots(g, {"main": "n"}, {}, ago(10))
    assert res.commits["n"].parents == ("x",)
    assert res.expired == {"y"}


def test_cycle_is_rejected() -> None:
    g = graph(C("a", "b", 1), C("b", "a", 2))
    with pytest.raises(ValueError):
        expire_snapshots(g, {"main": "a"}, {}, ago(10))
    with pytest.raises(ValueError):
        active_commits(g, {"main": "a"}, {}, RetentionPolicy(1), NOW)


def test_retained_commits_combines_expiration_then_retention() -> None:
    # Seed 001 graph with times in days: commit k is (15 - k) days old.
    g = {k: CommitRecord(ps, ago(15 - int(k))) for k, ps in PARENTS_001.items()}
    policy = RetentionPolicy(default_days=3, branch_days={"main": 30})
    plain = retained_commits(g, BRANCHES_001, TAGS_001, policy, NOW)
    assert plain == active_commits(g, BRANCHES_001, TAGS_001, policy, NOW)
    assert {"0", "1", "2", "4", "5", "12"} <= plain  # main's 30 days reach its root

    # Expire older than 7.5 days: main's ancestry becomes 14 13 12 0, so its 30-day
    # retention no longer reaches 1, 2, 4; they are dangling and older than the default.
    combined = retained_commits(g, BRANCHES_001, TAGS_001, policy, NOW, expire_older_than=ago(7.5))
    assert {"12", "13", "14", "0", "3", "5"} <= combined  # 3 and 5 still tagged
    assert combined & {"1", "2", "4", "6", "7"} == set()
    # The tags point at expired snapshots: listed for the service to delete, and they retain
    # until it has; once they are gone from the mirror, their commits are freed.
    res = expire_snapshots(g, BRANCHES_001, TAGS_001, ago(7.5))
    listed = refs_to_delete(BRANCHES_001, TAGS_001, res, default_branch="main")
    assert [(r.kind, r.name, r.commit) for r in listed] == [("tag", "tag1", "3"),
                                                            ("tag", "tag2", "5")]
    dropped = retained_commits(g, BRANCHES_001, {}, policy, NOW, expire_older_than=ago(7.5))
    assert dropped == combined - {"3", "5"}


# ---------------------------------------------------------------- properties


BRANCH_NAMES = ["main", "dev", "feat", "qa"]
TAG_NAMES = ["t1", "t2", "t3"]


@st.composite
def repos(draw: st.DrawFn) -> tuple[dict[str, CommitRecord], dict[str, str], dict[str, str]]:
    """Random DAG with monotone times (parents have lower index), some merges, some
    references to missing parents, random branches and tags."""
    n = draw(st.integers(1, 12))
    gaps = draw(st.lists(st.sampled_from([1.5, 1.0, 2.0, 0.0, 3.0]), min_size=n, max_size=n))
    times = list(itertools.accumulate((g * DAY for g in gaps), initial=ago(1.5 * n + 1)))[1:]
    commits: dict[str, CommitRecord] = {}
    for i in range(n):
        idx: list[int] = []
        if i and draw(st.integers(0, 5)):  # mostly a first parent among the last few commits
            idx.append(draw(st.integers(max(0, i - 3), i - 1)))
        if i > 1 and draw(st.integers(0, 3)) == 0:  # sometimes a merge parent
            merge = draw(st.integers(0, i - 1))
            if merge not in idx:
                idx.append(merge)
        parents = tuple(f"c{p}" for p in idx)
        if draw(st.integers(0, 9)) == 0:
            parents = (f"missing{i}", *parents)
        commits[f"c{i}"] = CommitRecord(parents, times[i])
    ids = sorted(commits, key=lambda c: -int(c[1:]))  # newest first: refs favour recent tips
    targets = st.sampled_from([*ids, "ghost"]) if draw(st.booleans()) else st.sampled_from(ids)
    branches = draw(st.dictionaries(st.sampled_from(BRANCH_NAMES), targets, max_size=4))
    tags = draw(st.dictionaries(st.sampled_from(TAG_NAMES), st.sampled_from(ids), max_size=3))
    return commits, branches, tags


days_st = st.sampled_from([0.0, 0.5, 1.0, 3.0, 7.0, 10.0, 30.0, math.inf])


@st.composite
def policies(draw: st.DrawFn) -> RetentionPolicy:
    per_branch = draw(st.dictionaries(st.sampled_from(BRANCH_NAMES), days_st, max_size=4))
    return RetentionPolicy(draw(days_st), per_branch)


thresholds = st.sampled_from([ago(d) for d in (2.5, 5, 8, 1, 0, 12, 30)])


@given(repos(), policies())
def test_prop_heads_and_tags_always_active(repo, policy) -> None:
    commits, branches, tags = repo
    active = active_commits(commits, branches, tags, policy, NOW)
    assert set(branches.values()) | set(tags.values()) <= active


@given(repos(), policies(), st.sampled_from([0.0, 0.5, 2.0, 10.0, math.inf]))
def test_prop_active_is_monotone_in_retention(repo, policy, extra) -> None:
    commits, branches, tags = repo
    longer = RetentionPolicy(
        policy.default_days + extra, {b: d + extra for b, d in policy.branch_days.items()}
    )
    shorter = active_commits(commits, branches, tags, policy, NOW)
    assert shorter <= active_commits(commits, branches, tags, longer, NOW)


@given(repos(), policies())
def test_prop_active_is_within_reach_of_refs_or_dangling(repo, policy) -> None:
    commits, branches, tags = repo
    active = active_commits(commits, branches, tags, policy, NOW)
    # infinite retention everywhere keeps every branch ancestry and every dangling commit
    everything = active_commits(commits, branches, tags, RetentionPolicy(math.inf), NOW)
    assert active <= everything
    assert set(commits) <= everything


@settings(max_examples=300)
@given(repos(), thresholds, st.sampled_from(["seed", "icechunk"]))
def test_prop_expiration_safety(repo, older_than, mode) -> None:
    commits, branches, tags = repo
    heads = [*branches.values(), *tags.values()]
    res = expire_snapshots(commits, branches, tags, older_than, mode=mode)
    after = reachable(res.commits, heads)
    before = reachable(commits, heads)
    # ref targets are never expired and never made unreachable
    assert set(heads) <= after
    assert not res.expired & set(heads)
    # seed mode: refs pointing at old snapshots keep them untouched
    for cid in heads:
        if mode == "seed" and cid in commits and commits[cid].time < older_than:
            assert res.commits[cid] == commits[cid]
    # newer commits reachable before remain reachable; only old ones expire
    assert {c for c in before if c in commits and commits[c].time >= older_than} <= after
    assert all(commits[c].time < older_than for c in res.expired)
    assert res.expired == {c for c in before - after if c in commits}
    # only the first parent of edited commits changes, and only towards the root
    for cid, commit in res.commits.items():
        if cid not in res.edited:
            assert commit == commits[cid]
        else:
            root = commit.parents[0]
            assert commit.parents[1:] == tuple(p for p in commits[cid].parents[1:] if p != root)
            assert commit.parents[0] != commits[cid].parents[0]
    # expiration is idempotent
    again = expire_snapshots(res.commits, branches, tags, older_than, mode=mode)
    assert again.commits == res.commits and again.edited == set()


@settings(max_examples=300)
@given(repos(), thresholds, st.data(), st.sampled_from(["seed", "icechunk"]))
def test_prop_expiration_independent_of_order(repo, older_than, data, mode) -> None:
    commits, branches, tags = repo
    refs = [("branch", b) for b in branches] + [("tag", t) for t in tags]
    order = data.draw(st.permutations(refs))
    a = expire_snapshots(commits, branches, tags, older_than, mode=mode)
    b = expire_snapshots(commits, branches, tags, older_than, order, mode=mode)
    assert a == b


@given(repos(), policies(), thresholds.filter(lambda t: t < NOW))
def test_prop_inputs_not_mutated(repo, policy, older_than) -> None:
    commits, branches, tags = repo
    snap = (dict(commits), dict(branches), dict(tags))
    res = expire_snapshots(commits, branches, tags, older_than)
    delete_expired_refs(branches, tags, res)
    refs_to_delete(branches, tags, res, default_branch="main")
    active_commits(commits, branches, tags, policy, NOW)
    retained = retained_commits(commits, branches, tags, policy, NOW,
                                expire_older_than=older_than)
    assert (commits, branches, tags) == snap
    assert res.commits is not commits
    # every ref the mirror has retains (issue 33): none is dropped for pointing at the expired
    assert set(branches.values()) | set(tags.values()) <= retained


# ------------------------------------------- expiration never acts on a live ref (issue 33)
#
# A ref the mirror has is live at the service as far as the reconciler knows: expiration may
# list it for the service to delete, never drop it from retention. Commit ids below carry
# their manifests so that the reconciler's own plan (reconciler/committed.py) can be judged.

NS_33 = Namespace("s3://bucket/repo/")
positive_days = st.sampled_from([0.5, 1.0, 2.5, 5.0, 7.0, 8.0, 12.0, 30.0])


def must_keep(commits: Mapping[str, CommitRecord], branches: Mapping[str, str],
              tags: Mapping[str, str], policy: RetentionPolicy, now: float,
              expire_at: float | None) -> set[str]:
    """What no expiration or retention option may ever free, stated on its own: every ref's
    target, and on each branch's first-parent ancestry every commit inside both the branch's
    retention window and the expiration threshold (expiration only ever takes what is older
    than its threshold)."""
    keep = set(branches.values()) | set(tags.values())
    for branch, head in branches.items():
        floor = policy.threshold(branch, now)
        if expire_at is not None:
            floor = max(floor, expire_at)
        seen: set[str] = set()
        cid: str | None = head
        while cid is not None and cid in commits and cid not in seen:
            seen.add(cid)
            if commits[cid].time >= floor:
                keep.add(cid)
            parents = commits[cid].parents
            cid = parents[0] if parents else None
    return keep


def _complete(commits: Mapping[str, CommitRecord], branches: Mapping[str, str]
              ) -> tuple[dict[str, CommitRecord], dict[str, str]]:
    """The generated repository as a mirror that knows every retained commit: no missing
    parents or ghost heads (those fail the run, which frees nothing), a manifest each."""
    full = {cid: CommitRecord(tuple(p for p in c.parents if p in commits), c.time, "",
                              f"m/{cid}") for cid, c in commits.items()}
    return full, {b: c for b, c in branches.items() if c in commits}


@settings(max_examples=300)
@given(repos(), policies(), positive_days, st.sampled_from(["seed", "icechunk"]))
def test_prop_expiration_never_frees_a_ref_target_or_a_retained_ancestor(
        repo, policy, days, mode) -> None:
    commits, branches, tags = repo
    expire_at = NOW - days * DAY
    kept = retained_commits(commits, branches, tags, policy, NOW, expire_older_than=expire_at,
                            mode=mode)
    assert must_keep(commits, branches, tags, policy, NOW, expire_at) <= kept
    assert must_keep(commits, branches, tags, policy, NOW, None) <= retained_commits(
        commits, branches, tags, policy, NOW)


@settings(max_examples=300)
@given(repos(), policies(), st.one_of(st.none(), positive_days),
       st.sampled_from(["seed", "icechunk"]), st.booleans(), st.sampled_from(["main", None]))
def test_prop_the_plan_keeps_every_live_ref_with_or_without_delete_expired_refs(
        repo, policy, days, mode, delete, default_branch) -> None:
    commits, branches, tags = repo
    commits, branches = _complete(commits, branches)
    state = CommittedState("r", NS_33, default_branch, policy, None, commits, branches, tags)
    plan = plan_retention(state, NOW, expire_older_than_days=days, mode=mode,
                          delete_expired_refs=delete)
    expire_at = None if days is None else NOW - days * DAY
    assert must_keep(commits, branches, tags, policy, NOW, expire_at) <= plan.retained
    assert {("m/" + c) for c in set(branches.values()) | set(tags.values())} <= {
        key[len(NS_33.prefix):] for _, key in plan.manifests}


def test_a_quiet_main_past_expiration_keeps_its_head_and_is_never_listed_for_deletion() -> None:
    """The hole of issue 33: main last committed 10 days ago, expiring older than 7 days with
    --delete-expired-refs, dropped main from retention and freed its head commit's data."""
    commits = {"a": CommitRecord((), ago(20), "main", "m/a"),
               "b": CommitRecord(("a",), ago(10), "main", "m/b")}
    branches = {"main": "b", "old": "a"}
    for mode in ("seed", "icechunk"):
        state = CommittedState("r", NS_33, "main", RetentionPolicy(1.0), None, commits,
                               branches, {"v1": "b"})
        plan = plan_retention(state, NOW, expire_older_than_days=7, mode=mode,
                              delete_expired_refs=True)
        assert plan.retained == {"a", "b"}
        assert plan.expired_refs == [("tag", "v1"), ("branch", "main"), ("branch", "old")]


def test_the_refs_listed_for_deletion_never_include_the_default_branch() -> None:
    g = graph(C("a", (), 20), C("b", "a", 10), C("c", "b", 1))
    branches = {"main": "b", "old": "a", "dev": "c"}
    tags = {"v1": "a", "v2": "c"}
    res = expire_snapshots(g, branches, tags, ago(7))
    assert res.refs_pointing_to_expired == (("tag", "v1"), ("branch", "main"),
                                            ("branch", "old"))

    def names(default: str | None, **kw: bool) -> list[tuple[str, str]]:
        return [(r.kind, r.name) for r in refs_to_delete(branches, tags, res,
                                                         default_branch=default, **kw)]

    assert names("main") == [("tag", "v1"), ("branch", "old")]
    assert names("old") == [("tag", "v1"), ("branch", "main")]
    # the default branch unknown: any branch might be it, so none is listed
    assert names(None) == [("tag", "v1")]
    assert names("main", delete_tags=False) == [("branch", "old")]
    assert names("main", delete_branches=False) == [("tag", "v1")]
    listed = refs_to_delete(branches, tags, res, default_branch="main")
    assert [(r.commit, r.commit_time) for r in listed] == [("a", ago(20)), ("a", ago(20))]
    # the model of the service's side keeps its default branch too
    assert delete_expired_refs(branches, tags, res) == ({"main": "b", "dev": "c"}, {"v2": "c"})


def test_a_threshold_that_would_expire_every_head_is_refused() -> None:
    g = graph(C("a", (), 20), C("b", "a", 10))
    policy = RetentionPolicy(1.0)
    # --expire-older-than-days 0 (or a threshold in the future) would count every head as
    # expired; NaN compares false with every time, so every ref's head would lose its ancestry
    for older_than in (NOW, NOW + DAY, math.nan):
        with pytest.raises(ValueError, match="threshold"):
            retained_commits(g, {"main": "b"}, {}, policy, NOW, expire_older_than=older_than)
    for mode in ("seed", "icechunk"):
        with pytest.raises(ValueError, match="NaN"):
            expire_snapshots(g, {"main": "b"}, {}, math.nan, mode=mode)
        with pytest.raises(ValueError, match="NaN"):
            expire_ref(g, "b", math.nan, mode=mode)
    assert retained_commits(g, {"main": "b"}, {}, policy, NOW,
                            expire_older_than=NOW - 1) == {"b"}


@pytest.mark.parametrize("days", [0.0, -1.0, math.nan])
def test_the_plan_refuses_an_expiration_of_zero_days_from_the_option_or_the_metadata(
        days: float) -> None:
    from reconciler.errors import ReconcileError

    commits = {"b": CommitRecord((), ago(10), "main", "m/b")}
    from_option = CommittedState("r", NS_33, "main", RetentionPolicy(1.0), None, commits,
                                 {"main": "b"}, {})
    from_meta = CommittedState("r", NS_33, "main", RetentionPolicy(1.0), days, commits,
                               {"main": "b"}, {})
    for state, option in ((from_option, days), (from_meta, None)):
        with pytest.raises(ReconcileError, match="expire_older_than_days must be > 0"):
            plan_retention(state, NOW, expire_older_than_days=option)
