"""The guards every delete path reads: fail-closed flags (a repository's and the global one) and
holds (Safety I)."""

from __future__ import annotations

from typing import Any

import orjson

from schemas.layout import FAIL_CLOSED, REPOS, RepoKeys


def _reason(h: dict[str, str] | None, scope: str) -> str | None:
    if not h:
        return None
    return f"{scope}: {h.get('reason') or 'fail-closed'}"


def fail_closed_reason(r: Any, repo: str) -> str | None:
    """Why the mirror of ``repo`` is not proven complete and current (nothing may be deleted
    for it), or None. Checks the repository's flag and the global one."""
    pipe = r.pipeline(transaction=False)
    pipe.hgetall(RepoKeys(repo).fail_closed)
    pipe.hgetall(FAIL_CLOSED)
    own, glob = pipe.execute()
    return _reason(own, "repository") or _reason(glob, "all repositories")


async def afail_closed_reason(r: Any, repo: str) -> str | None:
    """Async twin of :func:`fail_closed_reason` (two reads: works on Redis Cluster too)."""
    own = await r.hgetall(RepoKeys(repo).fail_closed)
    glob = await r.hgetall(FAIL_CLOSED) if not own else None
    return _reason(own, "repository") or _reason(glob, "all repositories")


def fail_closed_repos(r: Any) -> dict[str, dict[str, str]]:
    """Every fail-closed repository -> its flag (reason, at_ms, detail); key "*": global."""
    out: dict[str, dict[str, str]] = {}
    glob = r.hgetall(FAIL_CLOSED)
    if glob:
        out["*"] = glob
    repos = sorted(r.smembers(REPOS))
    pipe = r.pipeline(transaction=False)
    for repo in repos:
        pipe.hgetall(RepoKeys(repo).fail_closed)
    for repo, h in zip(repos, pipe.execute(), strict=True):
        if h:
            out[repo] = h
    return out


def holds(r: Any, repo: str) -> dict[str, dict[str, Any]]:
    """Held addresses of ``repo`` -> {claims, reason, source, at_ms} (delete paths keep
    them; schemas/holds.py)."""
    return {a: orjson.loads(v) for a, v in r.hgetall(RepoKeys(repo).holds).items()}


async def aholds(r: Any, repo: str) -> dict[str, dict[str, Any]]:
    return {a: orjson.loads(v) for a, v in (await r.hgetall(RepoKeys(repo).holds)).items()}
