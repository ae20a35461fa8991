"""Commit retention and snapshot expiration over a versioned commit graph.

Pure functions over immutable values; nothing here performs I/O.

Two policies are modelled:

* **Retention** (lakeFS committed retention, treeverse/lakeFS#1932) - :func:`active_commits`.
  For each branch, the commits of its *main ancestry* (first-parent chain from HEAD) that the
  branch HEAD pointed at, or moved past, during the branch's retention window are *active*.
  Only the data (manifests) of active commits must be retained; data reachable only from
  other commits may be hard-deleted.
* **Expiration** (Icechunk "update A in place") - :func:`expire_snapshots`. History is
  rewritten so that snapshots older than a threshold drop out of the ancestry of every ref;
  snapshots that become unreachable can then be garbage collected. Two readings of seed 001
  (:class:`ExpirationMode`): ``seed`` follows the seed's sample run exactly (a ref that points
  at an expired snapshot is never edited, so it keeps its whole ancestry: on the seed's
  history only 6 and 7 are freed); ``icechunk`` follows Icechunk 1.1 (every ref's own snapshot
  is re-parented to the root, even an expired one: tags lose their expired ancestry and 1, 2,
  4, 6, 7 are freed). Deleting the refs that point at expired snapshots (Icechunk's
  ``delete_expired_tags``/``branches``) frees 1-7 in both: :func:`delete_expired_refs` models
  what the refs become once the *service* deleted them.

:func:`retained_commits` combines them: expiration rewrites history first, then retention is
computed on the rewritten graph. Every ref it is given retains its commit: a ref the mirror
has is live at the service as far as the reconciler knows, so expiration never drops one here.
The refs that point at expired snapshots are only listed for the service to delete
(:func:`refs_to_delete`, never the default branch); once the service has deleted them they are
gone from the mirror, and retention frees their data like any deleted ref's.

Conventions: a commit's ``time`` is in epoch seconds and its first parent is its main
ancestry. The graph is a ``Mapping[str, CommitRecord]`` keyed by commit id (the mirror's one commit
record, ``schemas/records.py``). Ids that are
referenced (as a parent or by a ref) but absent from the mapping never cause an error: a
walk simply ends there. A cycle in the first-parent relation is corrupt input: it never
loops forever, and raises ``ValueError`` when met on a branch ancestry or by expiration.
The expiration guarantees stated below assume monotone timestamps (a commit is never older
than its parents), which Icechunk enforces at write time.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Literal, TypeVar

from schemas.records import CommitRecord

__all__ = [
    "SECONDS_PER_DAY",
    "ExpirationMode",
    "ExpirationResult",
    "ExpiredRef",
    "FrozenMap",
    "Ref",
    "RefKind",
    "RetentionPolicy",
    "active_commits",
    "delete_expired_refs",
    "expire_ref",
    "expire_snapshots",
    "reachable",
    "refs_to_delete",
    "retained_commits",
]

SECONDS_PER_DAY = 86400.0

RefKind = Literal["branch", "tag"]
# "seed": the seed's sample run (refs at expired snapshots are never edited, they keep their
# ancestry). "icechunk": Icechunk 1.1 (a ref's own snapshot is always the editable one when
# nothing newer is on its chain, so it is re-parented to the root even when expired).
ExpirationMode = Literal["seed", "icechunk"]
EXPIRATION_MODES: tuple[ExpirationMode, ...] = ("seed", "icechunk")
Ref = tuple[RefKind, str]

K = TypeVar("K")
V = TypeVar("V")


class FrozenMap(Mapping[K, V]):
    """An immutable, hashable mapping (hashable when its values are)."""

    __slots__ = ("_data", "_hash")

    def __init__(self, data: Mapping[K, V] | Iterable[tuple[K, V]] = ()) -> None:
        items: dict[K, V] = {}
        if isinstance(data, Mapping):
            for key in data:
                items[key] = data[key]
        else:
            for key, value in data:
                items[key] = value
        self._data = items
        self._hash: int | None = None

    def __getitem__(self, key: K) -> V:
        return self._data[key]

    def __iter__(self) -> Iterator[K]:
        return iter(self._data)

    def __len__(self) -> int:
        return len(self._data)

    def __hash__(self) -> int:
        if self._hash is None:
            self._hash = hash(frozenset(self._data.items()))
        return self._hash

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Mapping):
            return self._data == dict(other.items())
        return NotImplemented

    def __repr__(self) -> str:
        return f"FrozenMap({self._data!r})"


@dataclass(frozen=True, slots=True)
class RetentionPolicy:
    """Retention in days: a repository default and optional per-branch overrides.

    ``branch_days`` is stored as a :class:`FrozenMap`, so policies are hashable.
    Days must be non-negative; ``math.inf`` means "retain forever".
    """

    default_days: float
    branch_days: Mapping[str, float] = field(default_factory=lambda: FrozenMap[str, float]())

    def __post_init__(self) -> None:
        object.__setattr__(self, "branch_days", FrozenMap(self.branch_days))
        for name, days in (("<default>", self.default_days), *self.branch_days.items()):
            if math.isnan(days) or days < 0:
                raise ValueError(f"retention days for {name!r} must be >= 0, got {days!r}")

    def days_for(self, branch: str) -> float:
        """Retention days of ``branch`` (the repository default when it has no override)."""
        return self.branch_days.get(branch, self.default_days)

    def threshold(self, branch: str | None, now: float) -> float:
        """Epoch seconds of the start of the retention window (``None``: default policy)."""
        days = self.default_days if branch is None else self.days_for(branch)
        return now - days * SECONDS_PER_DAY


@dataclass(frozen=True, slots=True)
class ExpirationResult:
    """Outcome of :func:`expire_snapshots`.

    * ``commits`` - the rewritten graph (a new mapping; the input is untouched).
    * ``edited`` - ids whose ``parents`` were rewritten (the snapshots to update in place).
    * ``expired`` - ids present in the input that were reachable from some ref before and are
      unreachable after the rewrite, i.e. what garbage collection may now free. With monotone
      timestamps every one of them is older than the threshold. Commits that were already
      unreachable before are not reported.
    * ``refs_pointing_to_expired`` - ``(kind, name)`` of refs whose commit is older than the
      threshold. They keep their snapshot alive (in mode ``seed`` unedited, with its whole
      ancestry) until the service deletes them (:func:`refs_to_delete` lists them).
    """

    commits: FrozenMap[str, CommitRecord]
    edited: frozenset[str]
    expired: frozenset[str]
    refs_pointing_to_expired: tuple[Ref, ...]


@dataclass(frozen=True, slots=True)
class ExpiredRef:
    """A ref that points at an expired snapshot, listed for the service to delete."""

    kind: RefKind
    name: str
    commit: str
    commit_time: float  # epoch seconds


# --------------------------------------------------------------------------- helpers


def _cycle(start: str, at: str) -> ValueError:
    return ValueError(f"first-parent cycle reached from {start!r} at {at!r}")


def _first_parent_chain(commits: Mapping[str, CommitRecord], start: str) -> list[str]:
    """Present commits on the first-parent chain from ``start`` (inclusive), head first.

    Ends at a commit without parents or whose first parent is absent from ``commits``.
    """
    chain: list[str] = []
    seen: set[str] = set()
    cid: str | None = start
    while cid is not None and cid in commits:
        if cid in seen:
            raise _cycle(start, cid)
        seen.add(cid)
        chain.append(cid)
        parents = commits[cid].parents
        cid = parents[0] if parents else None
    return chain


def _walk_retention(
    commits: Mapping[str, CommitRecord],
    start: str,
    threshold: float,
    active: set[str],
    walked: dict[str, float],
) -> None:
    """Mark ``start`` and its first-parent ancestors the HEAD pointed at since ``threshold``.

    ``start`` is always marked. Walking towards the root, a parent is marked iff its child
    is not older than ``threshold`` (the HEAD moved from the parent to the child inside the
    window, so the parent is the commit it pointed at when the window opened, or later);
    the walk stops after the first commit older than ``threshold``. A parent missing from
    ``commits`` is marked (by that rule it is active) but not walked.

    ``walked`` memoises the lowest threshold already walked from a commit: a walk with a
    lower-or-equal threshold from the same commit marks a superset, so it is not repeated
    (this also ends any first-parent cycle).
    """
    cid = start
    while True:
        active.add(cid)
        previous = walked.get(cid)
        if previous is not None and previous <= threshold:
            return
        walked[cid] = threshold
        commit = commits.get(cid)
        if commit is None or commit.time < threshold or not commit.parents:
            return
        cid = commit.parents[0]


def _default_order(branch_heads: Mapping[str, str], tags: Mapping[str, str]) -> list[Ref]:
    refs: list[Ref] = [("tag", name) for name in sorted(tags)]
    refs.extend(("branch", name) for name in sorted(branch_heads))
    return refs


def _resolve_order(
    branch_heads: Mapping[str, str],
    tags: Mapping[str, str],
    order: Sequence[tuple[str, str]] | None,
) -> list[tuple[Ref, str]]:
    if order is None:
        refs = _default_order(branch_heads, tags)
    else:
        refs = []
        seen: set[tuple[str, str]] = set()
        for kind, name in order:
            if (kind, name) in seen:
                raise ValueError(f"ref {(kind, name)!r} listed twice in order")
            seen.add((kind, name))
            if kind == "branch" and name in branch_heads:
                refs.append(("branch", name))
            elif kind == "tag" and name in tags:
                refs.append(("tag", name))
            else:
                raise ValueError(f"unknown ref {(kind, name)!r} in order")
    return [(ref, branch_heads[ref[1]] if ref[0] == "branch" else tags[ref[1]]) for ref in refs]


def _check_mode(mode: str) -> None:
    if mode not in EXPIRATION_MODES:
        raise ValueError(f"expiration mode must be one of {EXPIRATION_MODES}, got {mode!r}")


def _check_threshold(older_than: float) -> None:
    # Every comparison with NaN is false: no commit would count as newer, so every ref's own
    # snapshot would become "A" and lose its whole ancestry.
    if math.isnan(older_than):
        raise ValueError("expiration threshold is NaN")


def _expire_into(graph: dict[str, CommitRecord], target: str, older_than: float,
                 mode: ExpirationMode = "seed") -> str | None:
    """Apply "update A in place" for one ref to ``graph``; return the edited id, if any."""
    head = graph.get(target)
    if head is None:
        return None
    if head.time < older_than and mode == "seed":
        # The seed: a ref that points at an expired snapshot is never edited.
        return None
    chain = _first_parent_chain(graph, target)
    root = chain[-1]
    # A: the last (deepest) non-expired commit of the ancestry. With monotone timestamps it
    # sits right before the first expired one; with skewed clocks choosing the deepest one
    # never abandons a non-expired commit of the chain.
    editable = target
    for cid in chain:
        if graph[cid].time >= older_than:
            editable = cid
    if editable == root:
        return None
    commit = graph[editable]
    if commit.parents[0] == root:
        return None
    # Only the main-ancestry link is cut: merge parents of A are not part of {X1..Xn}.
    parents = (root, *(p for p in commit.parents[1:] if p != root))
    graph[editable] = replace(commit, parents=parents)
    return editable


# --------------------------------------------------------------------------- public API


def reachable(commits: Mapping[str, CommitRecord], heads: Iterable[str]) -> frozenset[str]:
    """Ids reachable from ``heads`` following *all* parents (heads included).

    Referenced ids absent from ``commits`` (a missing head or parent) are included - they
    are referenced, so nothing named by them may be deleted - but cannot be walked further.
    """
    seen: set[str] = set()
    stack = list(heads)
    while stack:
        cid = stack.pop()
        if cid in seen:
            continue
        seen.add(cid)
        commit = commits.get(cid)
        if commit is not None:
            stack.extend(p for p in commit.parents if p not in seen)
    return frozenset(seen)


def active_commits(
    commits: Mapping[str, CommitRecord],
    branch_heads: Mapping[str, str],
    tags: Mapping[str, str],
    policy: RetentionPolicy,
    now: float,
) -> frozenset[str]:
    """Commits whose data must be retained under ``policy`` at time ``now`` (lakeFS #1932).

    * **Branches.** For each branch, with ``threshold = now - days_for(branch) * 86400``:
      the HEAD is always active; walking the first-parent ancestry from HEAD, commits with
      ``time >= threshold`` are active and so is the first commit older than ``threshold``
      (the commit HEAD pointed at when the window opened); the walk then stops. Merge
      (second and later) parents are not main ancestry and are never walked here.
    * **Dangling commits** - present commits on no branch's first-parent ancestry. Each
      dangling commit that is nobody's first parent (a tip; every dangling commit lies on
      the first-parent chain of such a tip) gets a hypothetical HEAD: a dummy child with the
      tip's time, walked with the repository default retention. Hence the tip and its
      ancestry are active only if ``tip.time >= threshold``; if so the walk proceeds as for
      a branch. Deleted branches' heads and merged-in (second-parent) commits land here.
    * **Tags** retain the commit they point at (always active, like lakeFS keeps tagged
      commits). A tag does not retain that commit's ancestry; a tagged commit off every
      branch ancestry is also covered by the dangling rule.
    * Ref targets are active even if absent from ``commits``. A missing first parent that
      the walk reaches is active (by the rule above) but ends the walk.

    Longer retention never shrinks the result.
    """
    active: set[str] = set()
    walked: dict[str, float] = {}

    ancestry: set[str] = set()
    for branch in sorted(branch_heads):
        head = branch_heads[branch]
        ancestry.update(_first_parent_chain(commits, head))
        _walk_retention(commits, head, policy.threshold(branch, now), active, walked)

    first_parents = {c.parents[0] for c in commits.values() if c.parents}
    default_threshold = policy.threshold(None, now)
    for cid in sorted(commits):
        if cid in ancestry or cid in first_parents:
            continue
        if commits[cid].time >= default_threshold:  # the dummy HEAD is inside the window
            _walk_retention(commits, cid, default_threshold, active, walked)

    active.update(branch_heads.values())
    active.update(tags.values())
    return frozenset(active)


def expire_ref(
    commits: Mapping[str, CommitRecord], target: str, older_than: float,
    mode: ExpirationMode = "seed",
) -> FrozenMap[str, CommitRecord]:
    """One step of "update A in place" for the ref pointing at ``target``; returns a new graph.

    If ``target`` is absent, or (mode ``seed``) older than ``older_than``, nothing changes.
    In mode ``icechunk`` an expired ``target`` is itself A when nothing newer is on its
    chain (Icechunk 1.1: the ref's snapshot keeps its id and loses its expired ancestry).
    Otherwise, with
    ``root`` the end of ``target``'s first-parent ancestry and ``A`` the deepest commit of
    that ancestry with ``time >= older_than``, A's first parent becomes ``root`` (unless A is
    ``root`` or already points at it); A's merge parents are kept. If the ancestry ends at
    a parent missing from ``commits``, the last present commit acts as ``root``.
    """
    _check_mode(mode)
    _check_threshold(older_than)
    graph = dict(commits)
    _expire_into(graph, target, older_than, mode)
    return FrozenMap(graph)


def expire_snapshots(
    commits: Mapping[str, CommitRecord],
    branch_heads: Mapping[str, str],
    tags: Mapping[str, str],
    older_than: float,
    order: Sequence[tuple[str, str]] | None = None,
    mode: ExpirationMode = "seed",
) -> ExpirationResult:
    """Expire snapshots older than ``older_than`` (Icechunk "update A in place").

    Refs are processed in ``order`` (``("branch" | "tag", name)`` pairs; default: tags then
    branches, each sorted by name); each step is :func:`expire_ref`. Refs not listed are not
    processed but still keep their snapshots reachable. Unknown or repeated refs raise
    ``ValueError``. The resulting graph does not depend on the order.

    Snapshots directly pointed at by a branch or tag are never expired. In mode ``seed`` they
    are not edited either when older than the threshold; in mode ``icechunk`` they are
    re-parented to the root (:func:`expire_ref`). With monotone timestamps no commit newer
    than the threshold that was reachable from a ref becomes unreachable.
    """
    _check_mode(mode)
    _check_threshold(older_than)
    refs = _resolve_order(branch_heads, tags, order)
    heads = [*branch_heads.values(), *tags.values()]
    graph = dict(commits)
    edited: set[str] = set()
    for _ref, target in refs:
        cid = _expire_into(graph, target, older_than, mode)
        if cid is not None:
            edited.add(cid)
    before = reachable(commits, heads)
    after = reachable(graph, heads)
    expired = frozenset(cid for cid in before - after if cid in commits)
    stale = tuple(
        (kind, name)
        for kind, name in _default_order(branch_heads, tags)
        if (target := (branch_heads[name] if kind == "branch" else tags[name])) in commits
        and commits[target].time < older_than
    )
    return ExpirationResult(FrozenMap(graph), frozenset(edited), expired, stale)


def refs_to_delete(
    branch_heads: Mapping[str, str],
    tags: Mapping[str, str],
    result: ExpirationResult,
    *,
    default_branch: str | None,
    delete_branches: bool = True,
    delete_tags: bool = True,
) -> tuple[ExpiredRef, ...]:
    """The refs of ``result.refs_pointing_to_expired`` the service may delete, with their commit.

    Icechunk's ``delete_expired_branches``/``delete_expired_tags``: deleting them makes their
    snapshots (and their exclusive ancestry) collectable. The default branch is never listed
    (Icechunk never deletes it); when it is unknown (``None``) no branch is, since any might be.
    Only the service deletes refs: until it has, they retain as every live ref does.
    """
    out: list[ExpiredRef] = []
    for kind, name in result.refs_pointing_to_expired:
        if kind == "branch":
            if not delete_branches or default_branch is None or name == default_branch:
                continue
            target = branch_heads[name]
        else:
            if not delete_tags:
                continue
            target = tags[name]
        out.append(ExpiredRef(kind, name, target, result.commits[target].time))
    return tuple(out)


def delete_expired_refs(
    branch_heads: Mapping[str, str],
    tags: Mapping[str, str],
    result: ExpirationResult,
    *,
    delete_branches: bool = True,
    delete_tags: bool = True,
    default_branch: str | None = "main",
) -> tuple[FrozenMap[str, str], FrozenMap[str, str]]:
    """New ``(branch_heads, tags)`` once the service deleted :func:`refs_to_delete`'s refs.

    A model of the service's side (Icechunk's default branch is ``main``), for the worked
    examples: the reconciler never applies it to the mirror's refs, it reads the refs the
    service has left.
    """
    gone = {(r.kind, r.name) for r in refs_to_delete(
        branch_heads, tags, result, default_branch=default_branch,
        delete_branches=delete_branches, delete_tags=delete_tags)}
    branches = FrozenMap(
        (name, cid) for name, cid in branch_heads.items() if ("branch", name) not in gone)
    kept_tags = FrozenMap((name, cid) for name, cid in tags.items() if ("tag", name) not in gone)
    return branches, kept_tags


def retained_commits(
    commits: Mapping[str, CommitRecord],
    branch_heads: Mapping[str, str],
    tags: Mapping[str, str],
    policy: RetentionPolicy,
    now: float,
    *,
    expire_older_than: float | None = None,
    order: Sequence[tuple[str, str]] | None = None,
    mode: ExpirationMode = "seed",
) -> frozenset[str]:
    """Ids of the commits whose manifests must be kept.

    Without ``expire_older_than`` this is :func:`active_commits`. With it, expiration runs
    first (:func:`expire_snapshots`) and retention is computed on the rewritten graph: expired
    commits have dropped out of every branch ancestry, so branch retention no longer reaches
    them; they are dangling and are kept only by the dangling-commit rule (repository default
    retention) or by a ref that still points at them. Retention decides which manifests are
    retained; expiration only decides which history retention gets to see.

    Every ref in ``branch_heads`` and ``tags`` retains its commit, expired or not: refs that
    point at expired snapshots are listed for the service (:func:`refs_to_delete`), never
    dropped here. A threshold not before ``now`` (``--expire-older-than-days 0``) would count
    every ref's head as expired and is refused (``ValueError``), as is NaN.
    """
    if expire_older_than is None:
        return active_commits(commits, branch_heads, tags, policy, now)
    _check_threshold(expire_older_than)
    if expire_older_than >= now:
        raise ValueError(f"expiration threshold {expire_older_than!r} is not before now "
                         f"({now!r}): every branch and tag head would count as expired")
    result = expire_snapshots(commits, branch_heads, tags, expire_older_than, order, mode)
    return active_commits(result.commits, branch_heads, tags, policy, now)
