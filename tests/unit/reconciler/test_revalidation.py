"""Property (pure, no servers): whatever branches, tags, commits and copies happen between a
mark and its sweep, nothing referenced at sweep time is deleted.

The mark and the sweep's re-validation are the production decisions (``records.verdict`` with
grace, ``state.record_digest``, ``state.retention_fingerprint``, ``committed.plan_retention``,
``mark.compute_mark``) composed as ``reconciler.job`` composes them on Spark; the tracker's
state is the tracker's own pure specification (``tracker.references``); the ground truth is
the model's."""

from __future__ import annotations

import random
from typing import Any

import orjson
from hypothesis import HealthCheck, given
from hypothesis import settings as hsettings
from hypothesis import strategies as st

from reconciler.committed import plan_retention
from reconciler.mark import Listed, compute_mark
from reconciler.records import verdict
from reconciler.retention import RetentionPolicy, retained_commits
from reconciler.s3io import Namespace
from reconciler.state import CommittedState, record_digest, retention_fingerprint
from schemas.records import AddressRecord
from sim.model import (
    Commit as MCommit,
)
from sim.model import (
    ManualClock,
    Model,
    ModelError,
    Workload,
    run_workload,
    seeded_ids,
)
from tracker.references import World

DAY = 86_400.0
GRACE_MS = 3_600_000


def record_hash(rec: AddressRecord) -> dict[str, str]:
    """An address record as the tracker's script stores it (schemas/README.md)."""
    h = {f"+{r}": t for r, t in rec.adds.items()}
    h.update({f"-{r}": t for r, t in rec.removes.items()})
    if rec.state is not None:
        h["state"] = rec.state.value
    for name, value in (("since", rec.since), ("iu", rec.issued_until), ("size", rec.size)):
        if value is not None:
            h[name] = str(value)
    if rec.committed:
        h["committed"] = "1"
    return h


class Tracked:
    """The tracker's state of one repository, read as the reconciler reads Redis."""

    def __init__(self, world: World, repo: str) -> None:
        self.st = world.repos[repo]
        assert self.st.meta is not None
        self.ns = Namespace(self.st.meta.namespace)
        self.tokens = {t: s.value for t, (s, _) in self.st.tokens.items()}
        self.records = {a: record_hash(r) for a, r in self.st.addresses.items()}

    def repo_state(self) -> CommittedState:
        st, meta = self.st, self.st.meta
        assert meta is not None
        commits = dict(st.commits)
        raw = [{"retention": orjson.dumps([meta.default_retention_days,
                                           sorted(meta.branch_retention_days.items())])
                .decode()},
               {cid: orjson.dumps([c.parents, c.time, c.manifest]).decode()
                for cid, c in st.commits.items()},
               {b: orjson.dumps([r.head, r.staging_token, list(r.sealed_tokens)]).decode()
                for b, r in st.branches.items()},
               dict(st.tags)]
        return CommittedState(
            st.repository, self.ns, meta.default_branch,
            RetentionPolicy(meta.default_retention_days, meta.branch_retention_days), None,
            commits, {b: r.head for b, r in st.branches.items() if r.head}, dict(st.tags),
            fingerprint=retention_fingerprint(*raw))

    def verdict(self, address: str, cutoff_ms: int, now_ms: int, *, grace: bool) -> Any:
        return verdict(self.records.get(address, {}), token_states=self.tokens,
                       cutoff_ms=cutoff_ms, now_ms=now_ms,
                       grace_ms=GRACE_MS if grace else 0, horizon_ms=now_ms)

    def digest(self, address: str) -> str | None:
        return record_digest(self.records.get(address), self.tokens)


def manifest_keys(model: Model, ns: Namespace, manifests: list[tuple[str, str]]) -> set[str]:
    """What the retained manifests list (the model wrote each commit's entries there)."""
    by_location = {Namespace(ns.uri).bucket + "/" + c.manifest.split("/", 3)[3]: c
                   for c in model.commits.values()}
    out: set[str] = set()
    for bucket, key in manifests:
        commit: MCommit = by_location[f"{bucket}/{key}"]
        out.update(a[len(ns.uri):] for a in commit.addresses())
    return out


def between_ops(model: Model, repo: str, rng: random.Random, n: int) -> None:
    """Random ref, commit and copy operations (branches and tags at old commits, copies of
    old data committed on main)."""
    r = model.repository(repo)
    for i in range(n):
        commits = list(r.commit_ids)
        kind = rng.choice(["branch", "tag", "copy_commit", "commit", "copy"])
        try:
            if kind == "branch" and commits:
                model.create_branch(repo, f"late{i}", rng.choice(commits))
            elif kind == "tag" and commits:
                model.create_tag(repo, f"late{i}", rng.choice(commits))
            elif kind in ("copy_commit", "copy") and commits:
                src = rng.choice(commits)
                paths = sorted(model.commits[src].entries)
                if not paths:
                    continue
                model.create_branch(repo, f"src{i}", src)
                model.copy(repo, f"src{i}", rng.choice(paths), r.default_branch, f"c/{i}")
                model.delete_branch(repo, f"src{i}")
                if kind == "copy_commit":
                    model.commit(repo, r.default_branch)
            elif kind == "commit":
                model.commit(repo, rng.choice(sorted(r.branches)))
        except ModelError:
            continue


@hsettings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 10**6), ops=st.integers(10, 90), n_between=st.integers(0, 8))
def test_nothing_referenced_at_sweep_time_is_deleted(seed: int, ops: int,
                                                     n_between: int) -> None:
    clock = ManualClock(start=1_700_000_000.0, step=1.0)
    model = Model(clock=clock, upload_ttl_seconds=600, new_id=seeded_ids(seed))
    wl = Workload(seed=seed, ops=ops, span_days=20, retention_days=3, bucket="b", name="p",
                  branches=3, paths=12)
    world = World()

    def track(events: list[Any]) -> None:
        for e in events:
            world.apply(e, int(e.emitted_at * 1000))

    track(run_workload(model, wl))
    repo = wl.repo_ids()[0]

    # ---- the mark, two days later (every upload expired, every grace window passed)
    clock.advance(2 * DAY)
    mark_ms = int(clock.now * 1000)
    cutoff_ms = mark_ms
    t = Tracked(world, repo)
    ns = t.ns
    state = t.repo_state()
    plan = plan_retention(state, mark_ms / 1000)
    committed = manifest_keys(model, ns, plan.manifests)
    known: dict[str, str] = {}
    live: set[str] = set()
    digests: dict[str, str | None] = {}
    for address in t.records:
        v = t.verdict(address, cutoff_ms, mark_ms, grace=True)
        rel = address[len(ns.uri):]
        known[rel] = v.kind
        digests[rel] = t.digest(address)
        if v.live:
            live.add(rel)
    listing = [Listed(a[len(ns.uri):], o.size, int(o.written_at * 1000))
               for a, o in model.objects.items() if o.repository == repo]
    mark = compute_mark(listing, cutoff_ms=cutoff_ms, committed=committed, uncommitted=live,
                        known=known)

    # ---- between the mark and the sweep
    clock.advance(60)
    first_new = len(model.events)
    between_ops(model, repo, random.Random(seed), n_between)
    track(model.events[first_new:])
    clock.advance(60)
    sweep_ms = int(clock.now * 1000)

    # ---- the sweep's re-validation (reconciler.job._revalidate and sweep._sweep_batch)
    now = Tracked(world, repo)
    state_now = now.repo_state()
    protected: set[str] = set()
    if state_now.fingerprint != state.fingerprint:
        plan_now = plan_retention(state_now, mark_ms / 1000)
        new = [m for m in plan_now.manifests if m not in set(plan.manifests)]
        protected = manifest_keys(model, ns, new)
    deleted = set()
    for obj, _category in mark.marked:
        address = ns.address(obj.key)
        if obj.key in protected:
            continue
        if address in now.records and now.verdict(address, cutoff_ms, sweep_ms,
                                                  grace=False).live:
            continue  # sweep.still_referenced: a record that is live again
        if now.digest(address) != digests.get(obj.key):
            continue
        deleted.add(address)

    # ---- the truth at sweep time: what the model says may go
    rep = model.repository(repo)
    graph = model.commit_graph(repo)
    heads = {b: br.head for b, br in rep.branches.items() if br.head}
    retained_now = retained_commits(graph, heads, dict(rep.tags),
                                    RetentionPolicy(rep.default_retention_days,
                                                    rep.branch_retention_days),
                                    sweep_ms / 1000)
    may_go = model.reconciler_garbage(retained_now, repository=repo, now=sweep_ms / 1000,
                                      grace_seconds=GRACE_MS / 1000, horizon=sweep_ms / 1000)
    assert deleted <= may_go, sorted(deleted - may_go)
    if n_between == 0:
        # nothing happened in between: the sweep deletes the whole mark
        assert deleted == {ns.address(o.key) for o, _ in mark.marked}
