"""The repositories the trackers have seen, their namespaces, and the namespace registry
``hd:namespaces`` (one atomic script call each; ``a``-prefixed functions are the async
versions). :func:`find_owner` is the one answer to "which repository owns this address", for
the operator commands as for the gate: the registry the delete paths check, not a scan of
repository metadata in whatever order."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import orjson

from schemas.address import canonical_namespace, canonical_uri
from schemas.layout import INCIDENTS, NAMESPACES, REPOS, OutsideNamespace, RepoKeys
from schemas.namespaces import Conflict, conflict_reason, standing_conflict

NAMESPACES_LUA = """
local repo, ns = ARGV[1], ARGV[2]
if ARGV[3] == 'free' then
  if redis.call('HGET', KEYS[1], ns) == repo then redis.call('HDEL', KEYS[1], ns) end
  return {1}
end
local function inside(a, b) return #a >= #b and string.sub(a, 1, #b) == b end
local function before(a, b)  -- byte order, like Python's (Lua's < follows the locale)
  for i = 1, math.min(#a, #b) do
    local x, y = string.byte(a, i), string.byte(b, i)
    if x ~= y then return x < y end
  end
  return #a < #b
end
local h = redis.call('HGETALL', KEYS[1])
local found, owner
for i = 1, #h, 2 do
  local other, who = h[i], h[i + 1]
  local clash
  if who == repo then clash = other ~= ns else clash = inside(ns, other) or inside(other, ns) end
  if clash and (found == nil or before(other, found)) then found, owner = other, who end
end
if found then return {0, found, owner} end
redis.call('HSET', KEYS[1], ns, repo)
return {1}
"""


def _registered(repo: str, namespace: str, res: Any) -> str | None:
    if int(res[0]) == 1:
        return None
    return conflict_reason(repo, namespace, str(res[1]), str(res[2]))


def register_namespace(r: Any, repo: str, namespace: str) -> str | None:
    """Register a repository's (canonical) namespace; the refusal reason, or None."""
    return _registered(repo, namespace, r.eval(NAMESPACES_LUA, 1, NAMESPACES, repo, namespace,
                                               "register"))


async def aregister_namespace(r: Any, repo: str, namespace: str) -> str | None:
    return _registered(repo, namespace, await r.eval(NAMESPACES_LUA, 1, NAMESPACES, repo,
                                                     namespace, "register"))


def free_namespace(r: Any, repo: str, namespace: str) -> None:
    """A retired repository's namespace may be registered again (only if it still owns it)."""
    r.eval(NAMESPACES_LUA, 1, NAMESPACES, repo, namespace, "free")


async def afree_namespace(r: Any, repo: str, namespace: str) -> None:
    await r.eval(NAMESPACES_LUA, 1, NAMESPACES, repo, namespace, "free")


def namespace_registry(r: Any) -> dict[str, str]:
    """``hd:namespaces``: live namespace -> repository (for ``ownership_problem``)."""
    return dict(r.hgetall(NAMESPACES))


def repositories(r: Any) -> set[str]:
    """Repository ids the tracker has seen (``hd:repos``)."""
    return set(r.smembers(REPOS))


def repo_namespace(r: Any, repo: str) -> str | None:
    """The namespace a repository's metadata names (as its ``repository_created`` spelled it),
    or None for a repository the tracker has not seen."""
    ns = r.hget(RepoKeys(repo).meta, "namespace")
    return str(ns) if ns else None


async def arepo_namespace(r: Any, repo: str) -> str | None:
    ns = await r.hget(RepoKeys(repo).meta, "namespace")
    return str(ns) if ns else None


# A repository's namespace and whether it is retired: the two metadata fields every lifecycle
# check reads (a retired repository keeps its namespace in its metadata, for explain).
_LIFECYCLE = ("namespace", "retired_at")


def _lifecycle(values: Any) -> tuple[str | None, bool]:
    ns, retired_at = values
    return (str(ns) if ns else None), bool(retired_at)


def repo_lifecycle(r: Any, repo: str) -> tuple[str | None, bool]:
    """(namespace or None, retired?) of a repository, from its metadata."""
    return _lifecycle(r.hmget(RepoKeys(repo).meta, list(_LIFECYCLE)))


async def arepo_lifecycles(r: Any, repos: Iterable[str]) -> dict[str, tuple[str | None, bool]]:
    """:func:`repo_lifecycle` of many repositories in one round trip."""
    ordered = list(repos)
    pipe = r.pipeline(transaction=False)
    for repo in ordered:
        pipe.hmget(RepoKeys(repo).meta, list(_LIFECYCLE))
    return {repo: _lifecycle(v) for repo, v in zip(ordered, await pipe.execute(), strict=True)}


def owner_of(registry: Mapping[str, str], address: str) -> tuple[str, str] | None:
    """(repository, namespace) of the registered namespace containing the canonical
    ``address``, or None. Pure. Registered namespaces never overlap (the registration script
    refuses it); the longest wins should a hand-edited registry hold two."""
    found = [(ns, repo) for ns, repo in registry.items() if address.startswith(ns)]
    if not found:
        return None
    ns, repo = max(found, key=lambda f: len(f[0]))
    return repo, ns


def owned_namespaces(r: Any) -> dict[str, str]:
    """Canonical namespace -> repository, as the delete paths' ownership check reads it (the
    registry). Without a registry yet (a store written before it existed), the repositories'
    own namespaces in canonical form stand in, as the gate's legacy check does."""
    spelled = namespace_registry(r)
    if not spelled:
        spelled = {ns: repo for repo in sorted(repositories(r))
                   if (ns := repo_namespace(r, repo))}
    registry = {}
    for ns, repo in spelled.items():
        try:
            registry[canonical_namespace(ns)] = repo
        except OutsideNamespace:
            continue
    return registry


def find_owner(r: Any, address: str) -> tuple[str, str] | None:
    """(repository, canonical namespace) owning ``address`` (scheme and bucket in any case;
    ``schemas.holds.resolve_target`` reads every spelling), or None."""
    try:
        address = canonical_uri(address)
    except OutsideNamespace:
        return None
    return owner_of(owned_namespaces(r), address)


# --- registry conflicts (schemas/README.md, "Registry conflicts") ------------------------------

async def afail_closed_conflict(r: Any, conflict: Conflict, *, now_ms: int, event_id: str = "",
                                incident: dict[str, Any] | None = None) -> None:
    """Fail closed every repository of ``conflict`` (its own flag: the reaper, the sweep and
    the purges of each delete nothing), then record one incident that names them all
    (``incident``: extra fields; None: the caller records it). Idempotent but for the loss
    counter, which makes a rebuild prepared before stale. Once every one carries this conflict's
reason, nothing is written again."""
    reason = conflict.reason()
    flagged = [await r.hget(RepoKeys(repo).fail_closed, "reason")
               for repo in conflict.repositories]
    if all(f == reason for f in flagged):
        return  # recorded already (a tracker restarted, a refusal delivered again)
    detail = orjson.dumps({"kind": "registry_conflict",
                           "members": [list(m) for m in conflict.members]}).decode()
    for repo in conflict.repositories:
        k = RepoKeys(repo)
        pipe = r.pipeline(transaction=False)
        pipe.hsetnx(k.fail_closed, "reason", reason)
        pipe.hsetnx(k.fail_closed, "at_ms", str(now_ms))
        pipe.hsetnx(k.fail_closed, "detail", detail)
        pipe.hincrby(k.fail_closed, "losses", 1)
        await pipe.execute()
    if incident is not None:
        await r.rpush(INCIDENTS, orjson.dumps({
            "kind": "registry_conflict", "repository": conflict.repositories[0],
            "repositories": conflict.repositories,
            "namespaces": {repo: ns for repo, ns in conflict.members},
            "reason": reason, "event_id": event_id, "at_ms": now_ms, **incident}))


def conflicts_standing(r: Any, repos: Iterable[str]) -> dict[str, Conflict]:
    """The registry conflict each of ``repos`` is still in (its namespace overlaps one the
    registry holds for another repository, or another live repository's own); repositories
    in none are left out."""
    wanted = set(repos)
    holders = [(str(owner), str(ns)) for ns, owner in namespace_registry(r).items()]
    live = sorted(repositories(r) | wanted)
    pipe = r.pipeline(transaction=False)
    for name in live:
        pipe.hmget(RepoKeys(name).meta, list(_LIFECYCLE))
    for name, values in zip(live, pipe.execute(), strict=True):
        ns, retired = _lifecycle(values)
        if ns and not retired:
            holders.append((name, ns))
    return {repo: c for repo in sorted(wanted) if (c := standing_conflict(repo, holders))}


def conflict_standing(r: Any, repo: str) -> Conflict | None:
    return conflicts_standing(r, [repo]).get(repo)
