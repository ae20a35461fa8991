"""Events for the differential tests of the tracker: the pure reference machine
(``tracker.references.World``) applied in order, compared up to the sticky committed flag;
random ref-heavy operations of the model service, reordered and duplicated; chaos over small
pools (contract violations, reorderings, duplicates, the reaper between batches) applied to
the pure machine and, batch by batch as the daemon does, to the Lua script in a real Redis."""

from __future__ import annotations

import copy
import random
from collections.abc import Iterable
from typing import Any

from schemas import events as ev
from schemas.layout import NAMESPACES as REGISTRY
from schemas.layout import REPOS as REPO_SET
from schemas.layout import RepoKeys, TokenState
from sim.model import ManualClock, Model, ModelError, seeded_ids
from sim.testing import LuaTracker, canonical, reap, refused_incidents
from tracker.references import REF_DOUBT, TOKEN_CONTESTED, Incident, RepoState, World
from tracker.state import read_repo_state

NOW = 1_000_000


def apply_all(events: list[ev.Event], now: int = NOW) -> World:
    w = World()
    for e in events:
        w.apply(e, now)
    return w


def order_free_incidents(st_: RepoState) -> None:
    """A doubt's incident names the event that revealed it, which depends on the order; what
    does not is that there is one per contradicted address or contested token."""
    st_.incidents = [Incident(i.repository, i.address, "", "", "", i.at_ms, i.kind,
                              i.token if i.kind == TOKEN_CONTESTED else "")
                     if i.kind in (REF_DOUBT, TOKEN_CONTESTED) else i for i in st_.incidents]


def sticky_only_difference(a: RepoState, b: RepoState) -> None:
    """a and b are equal except for addresses that one of them holds committed because a
    reference of an already-committed token was added before its removal was seen (the sticky
    flag: conservative, the reconciler reclaims it) or because a reused reference id named a
    committed token before or after its other token (both records carry the sticky ``doubt``,
    which keeps the address on every path whatever its other flags say), and the revealing
    event of a doubt's incident. Anything else is a bug."""
    a, b = copy.deepcopy(a), copy.deepcopy(b)
    order_free_incidents(a)
    order_free_incidents(b)
    for address in set(a.addresses) | set(b.addresses):
        ra, rb = a.addresses[address], b.addresses[address]
        if ra.committed != rb.committed:
            held = ra if ra.committed else rb
            assert (ra.doubt and rb.doubt) or any(
                ref in held.removes and a.token_state(tok) is TokenState.COMMITTED
                for ref, tok in held.adds.items()), address
            for st_ in (a, b):
                st_.addresses.pop(address)
                st_.unreferenced.pop(address, None)
    assert canonical(a, counters=False) == canonical(b, counters=False)


REF_NS = "s3://b/r/"


def ref_operations(seed: int, n: int) -> list[ev.Event]:
    """The model service's events for random ref-heavy operations over small name pools, so
    branches and tags are deleted and created again under the same names (versions continue)."""
    rng = random.Random(seed)
    m = Model(clock=ManualClock(step=0.01), new_id=seeded_ids(seed))
    events: list[ev.Event] = list(m.create_repository("r", REF_NS))
    branches, tags, paths = ["main", "dev", "feat"], ["v1", "v2"], ["a", "b", "c"]
    ops = [
        lambda: m.write("r", rng.choice(branches), rng.choice(paths), 1),
        lambda: m.write("r", rng.choice(branches), rng.choice(paths), 1),
        lambda: m.delete("r", rng.choice(branches), rng.choice(paths)),
        lambda: m.commit("r", rng.choice(branches)),
        lambda: m.seal("r", rng.choice(branches)),
        lambda: m.merge("r", rng.choice(branches), rng.choice(branches)),
        lambda: m.reset_branch("r", rng.choice(branches)),
        lambda: m.create_branch("r", rng.choice(branches), rng.choice([None, *branches])),
        lambda: m.delete_branch("r", rng.choice(branches)),
        lambda: m.create_tag("r", rng.choice(tags), rng.choice(branches)),
        lambda: m.delete_tag("r", rng.choice(tags)),
    ]
    for _ in range(n):
        try:
            events += rng.choice(ops)()
        except ModelError:
            continue
    return events


def permuted_with_duplicates(events: list[ev.Event], rng: random.Random,
                             dups: int) -> list[ev.Event]:
    """Any order of everything after repository_created, with ``dups`` extra copies (a retried
    publish) anywhere."""
    rest = list(events[1:])
    rest += [rng.choice(rest) for _ in range(dups if rest else 0)]
    rng.shuffle(rest)
    return events[:1] + rest


# --- chaos: any events over small pools, applied to both machines ----------------------------

NS = "s3://b/r0/"
REPOS = ["r0", "r1", "r2"]  # r1, r2: created (or refused) along the way, on overlapping namespaces
NAMESPACES = [NS, NS, "s3://b/", "s3://b/r0/sub/", "s3://b/z/", "s3://c/"]
ADDRS = [NS + "data/a", NS + "data/b", NS + "data/c", "s3://other/x", NS + "_hardelete/m"]
REFS = [f"ref{i}" for i in range(6)]
TOKS = [f"tok{i}" for i in range(4)]
BRANCHES = ["main", "dev"]
COMMITS = ["c1", "c2"]


def chaos_events(rng: random.Random, n: int) -> list[ev.Event | tuple[str, str]]:
    """Any events over small pools: contract violations, reorderings and duplicates included;
    ("reap", address) items let the test play the reaper between batches."""
    out: list[ev.Event | tuple[str, str]] = []
    c = rng.choice

    def addr() -> str:
        return c(ADDRS[:3]) if rng.random() < 0.85 else c(ADDRS)

    for _ in range(n):
        if out and rng.random() < 0.08:  # a duplicate (a retried publish)
            out.append(c(out))
            continue
        kind = rng.randrange(14)
        tok = c(TOKS)
        common: dict[str, Any] = {"repository": "r0" if rng.random() < 0.8 else c(REPOS[1:]),
                                  "event_id": f"e{rng.randrange(10**6)}"}
        version: dict[str, Any] = {"ref_version": c([0, 1, 2, 3, 4, 5])}
        if kind <= 2:
            ref = c(REFS)
            rep = (c(REFS), addr()) if rng.random() < 0.3 else None
            if rep is not None and rep[0] == ref:
                rep = None
            cls = ev.ObjectWritten if kind < 2 else ev.ObjectCopied
            extra: dict[str, Any] = {"source_read_at": 1.0} if kind == 2 else {}
            out.append(cls(**common, **extra, branch="main", staging_token=tok, path="p",
                           address=addr(), size=rng.randrange(4), ref_id=ref,
                           replaces_ref_id=rep[0] if rep else None,
                           replaces_address=rep[1] if rep else None))
        elif kind <= 4:
            out.append(ev.ObjectDeleted(**common, branch="main", staging_token=tok, path="p",
                                        address=addr(), ref_id=c(REFS)))
        elif kind == 5:
            out.append(ev.AddressIssued(**common, address=addr(),
                                        ttl_seconds=c([0.001, 1.5, 3600.0])))
        elif kind == 6:
            out.append(ev.CommitCreated(**common, **version, branch=c(BRANCHES),
                                        commit_id=c(COMMITS), parents=[],
                                        sealed_tokens=rng.sample(TOKS, rng.randrange(3)),
                                        staging_token=tok, committed_at=1.0, manifest=NS + "m"))
        elif kind == 7:
            out.append(ev.BranchReset(**common, **version, branch=c(BRANCHES),
                                      dropped_tokens=rng.sample(TOKS, rng.randrange(3)),
                                      staging_token=tok, head=c([None, *COMMITS])))
        elif kind == 8:
            out.append(ev.BranchDeleted(**common, **version, branch=c(BRANCHES),
                                        dropped_tokens=rng.sample(TOKS, rng.randrange(3))))
        elif kind == 9:
            out.append(ev.BranchCreated(**common, **version, branch=c(BRANCHES),
                                        staging_token=tok, source_commit=c([None, *COMMITS])))
        elif kind == 10:
            out.append(c([ev.TagCreated(**common, **version, tag=c(["v1", "v2"]),
                                        commit_id=c(COMMITS)),
                          ev.TagDeleted(**common, **version, tag=c(["v1", "v2"]))]))
        elif kind == 11:
            out.append(("reap", c(ADDRS[:3])))
        elif kind == 12:
            out.append(ev.RepositoryDeleted(**common, storage_namespace=c(NAMESPACES)))
        else:
            out.append(ev.RepositoryCreated(**common, storage_namespace=c(NAMESPACES),
                                            default_branch="main", default_retention_days=1.5,
                                            branch_retention_days={"main": 2.0}))
    return out


def run_both(r: Any, items: Iterable[ev.Event | tuple[str, str]], batch_sizes: Iterable[int],
             now0: int = 1_000_000, step: int = 1_000) -> World:
    """Apply to the pure world and (in batches, as the daemon does: gate, namespace registry,
    script, retirements) via Lua; also re-send the last batch (redelivery)."""
    r.flushall()
    world = World()
    lua = LuaTracker(r)
    base = [ev.RepositoryCreated(repository="r0", storage_namespace=NS, default_branch="main",
                                 default_retention_days=1.0, event_id="e-root")]
    items = base + list(items)
    i, offset, now, sizes = 0, 0, now0, iter(batch_sizes)
    last_batch = None
    while i < len(items):
        n = max(1, next(sizes, 7))
        chunk = items[i:i + n]
        i += n
        events = []
        for item in chunk:
            if isinstance(item, tuple):  # the reaper acts between batches
                _, address = item
                for repo, state in world.repos.items():
                    rec = state.addresses.get(address)
                    if (state.retired_at is None and rec is not None
                            and rec.state in ("unreferenced", "issued")):
                        reap(r, world, repo, address, now)
                continue
            events.append(item)
        expected_rejections = []
        for e in events:
            out = world.apply(e, now)
            expected_rejections.append(out.rejected)
        world.settle()  # the batch is applied: retired namespaces are free
        rejected, _ = lua.batch(events, now, offset)
        got = {off - offset: reason for off, reason in rejected}
        assert got == {k: v for k, v in enumerate(expected_rejections) if v}
        last_batch = (events, now, offset)
        offset += len(events)
        now += step
    assert refused_incidents(r) == world.refused
    assert r.hgetall(REGISTRY) == world.namespaces
    assert r.smembers(REPO_SET) == {repo for repo, st_ in world.repos.items()
                                    if st_.retired_at is None}
    if last_batch:  # redelivery of the last batch changes nothing
        events, now, first = last_batch
        _, results = lua.batch(events, now + 5, first)
        assert all(res[0] == 0 for res in results)
    for repo in REPOS:
        if repo in world.repos:
            assert canonical(read_repo_state(r, repo)) == canonical(world.repos[repo])
        else:
            assert not list(r.scan_iter(match=RepoKeys(repo).tag.replace("{", "\\{") + "*"))
    return world
