"""Namespace ownership: which live repository an address belongs to (SPEC safety 3 and 8).

Pure functions over the registry ``hd:namespaces`` (namespace -> repository id, live
repositories only; ``schemas/layout.py``). The tracker refuses a repository whose namespace
equals, contains or lies inside a registered one; every delete path calls
:func:`ownership_problem` right before its request, so neither a bad registration nor a stale
queue of a retired repository can steer a delete into another repository's data.

Namespaces are compared in their canonical form (``schemas.address.canonical_namespace``):
``s3://`` and the bucket in lower case, the prefix as given (S3 keys are case-sensitive), one
trailing slash.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from schemas.address import canonical_namespace
from schemas.layout import OutsideNamespace, namespace_key


def overlaps(a: str, b: str) -> bool:
    """Whether two canonical namespaces are equal or one lies inside the other."""
    return a.startswith(b) or b.startswith(a)


def namespace_problem(namespace: str) -> str | None:
    """Why ``namespace`` cannot be registered as given, or None: it must be canonical, so that
    the registry, the repository meta and every address check compare the same string."""
    try:
        ns = canonical_namespace(namespace)
    except OutsideNamespace as exc:
        return str(exc)
    if ns != namespace:
        return f"storage namespace {namespace!r} is not canonical (expected {ns!r})"
    return None


def registration_problem(registry: Mapping[str, str], repo: str, namespace: str) -> str | None:
    """Why ``repo`` may not register ``namespace`` (canonical) now, or None.

    Refused: a namespace that equals, contains or lies inside a namespace of another live
    repository, and a second namespace for a repository that already owns one. The conflict
    reported is the first in namespace order (``apply``'s registry script reports the same one).
    """
    for other_ns, owner in sorted(registry.items()):
        if owner == repo:
            if other_ns != namespace:
                return conflict_reason(repo, namespace, other_ns, owner)
        elif overlaps(namespace, other_ns):
            return conflict_reason(repo, namespace, other_ns, owner)
    return None


def conflict_reason(repo: str, namespace: str, other_ns: str, owner: str) -> str:
    """The dead-letter reason for a refused registration (one wording for spec and script)."""
    if owner == repo:
        return (f"repository {repo!r} already owns storage namespace {other_ns!r}, "
                f"not {namespace!r}")
    how = ("equals" if namespace == other_ns
           else "contains" if other_ns.startswith(namespace) else "lies inside")
    return (f"storage namespace {namespace!r} of repository {repo!r} {how} namespace "
            f"{other_ns!r} of repository {owner!r}, live or retired with its data still kept "
            "(namespace overlap)")


def conflicting_owner(registry: Mapping[str, str], repo: str, namespace: str) -> str | None:
    """The live repository (other than ``repo``) whose namespace overlaps ``namespace``."""
    ns = canonical_namespace(namespace)
    for other_ns, owner in sorted(registry.items()):
        if owner != repo and overlaps(ns, other_ns):
            return owner
    return None


def ownership_problem(registry: Mapping[str, str], repo: str, namespace: str,
                      address: str) -> str | None:
    """Why ``repo`` must not delete ``address`` now, or None.

    ``registry``: the live registry (namespace -> repository), read right before the request.
    The address must lie in ``namespace`` (not reserved, a plain key), ``namespace`` must be
    registered to ``repo`` (a retired repository owns nothing), and no other live repository's
    namespace may contain the address.
    """
    try:
        namespace_key(namespace, address)
    except OutsideNamespace as exc:
        return str(exc)
    if registry.get(namespace) != repo:
        owner = registry.get(namespace)
        return (f"namespace {namespace!r} is not owned by live repository {repo!r}"
                + (f" (owner: {owner!r})" if owner else " (repository retired or unknown)"))
    for other_ns, owner in registry.items():
        if owner != repo and address.startswith(other_ns):
            return f"{address!r} lies in namespace {other_ns!r} of repository {owner!r}"
    return None


# --- registry conflicts ---------------------------------------------------------------------

@dataclass(frozen=True)
class Conflict:
    """Repositories whose namespaces overlap (equal or nested), each with its namespace. The
    sweep of the one whose namespace contains the other's would take the other's data for
    its own garbage, so every one of them is fail-closed until an operator resolves it
    (schemas/README.md, "Registry conflicts")."""

    members: tuple[tuple[str, str], ...]  # (repository, namespace), sorted

    @property
    def repositories(self) -> list[str]:
        return sorted({repo for repo, _ in self.members})

    def reason(self) -> str:
        named = ", ".join(f"{repo!r} ({ns})" for repo, ns in self.members)
        return (f"registry conflict: the storage namespaces of {named} overlap; nothing of "
                "them is deleted until an operator resolves it (schemas/README.md, Registry "
                "conflicts)")


def conflict_of(repo: str, namespace: str, registry: Mapping[str, str]) -> Conflict | None:
    """``repo`` with ``namespace`` and every other repository whose registered namespace
    equals, contains or lies inside it, or None (no overlap, or a namespace that is no
    namespace). Pure."""
    try:
        ns = canonical_namespace(namespace)
    except OutsideNamespace:
        return None
    others = {(owner, other) for other, owner in registry.items()
              if owner != repo and overlaps(ns, other)}
    if not others:
        return None
    return Conflict(tuple(sorted({(repo, ns), *others})))


def standing_conflict(repo: str, holders: Iterable[tuple[str, str]]) -> Conflict | None:
    """The conflict ``repo`` is still in, or None. ``holders``: (repository, namespace) of
    every namespace held now: the registry's entries (live repositories, and retired ones
    whose data is kept) and each live repository's own namespace. Pure."""
    held = set()
    for owner, namespace in holders:
        try:
            held.add((owner, canonical_namespace(namespace)))
        except OutsideNamespace:
            continue
    mine = {ns for owner, ns in held if owner == repo}
    members = {(owner, ns) for owner, ns in held if owner != repo
               and any(overlaps(ns, m) for m in mine)}
    if not members:
        return None
    return Conflict(tuple(sorted(members | {(repo, m) for m in mine})))
