"""The guards every delete path reads: fail-closed flags (a repository's and the global one) and
holds (Safety I)."""

from __future__ import annotations

from typing import Any

import orjson

from schemas.layout import FAIL_CLOSED, REPOS, RETIRED, RepoKeys


def fail_closed_text(global_reason: str | None, repo_reason: str | None) -> str | None:
    """The one wording and precedence of fail-closed (every reader and the gate use it): the
    global flag first, since it covers the repository's."""
    if global_reason is not None:
        return f"all repositories: {global_reason or 'fail-closed'}"
    if repo_reason is not None:
        return f"repository: {repo_reason or 'fail-closed'}"
    return None


def _flag(h: dict[str, str] | None) -> str | None:
    return None if not h else (h.get("reason") or "")


def fail_closed_reason(r: Any, repo: str) -> str | None:
    """Why the mirror of ``repo`` is not proven complete and current (nothing may be deleted
    for it), or None. Checks the global flag and the repository's (two reads: works on Redis
    Cluster too)."""
    glob = r.hgetall(FAIL_CLOSED)
    own = r.hgetall(RepoKeys(repo).fail_closed) if not glob else None
    return fail_closed_text(_flag(glob), _flag(own))


async def afail_closed_reason(r: Any, repo: str) -> str | None:
    """Async twin of :func:`fail_closed_reason`."""
    glob = await r.hgetall(FAIL_CLOSED)
    own = await r.hgetall(RepoKeys(repo).fail_closed) if not glob else None
    return fail_closed_text(_flag(glob), _flag(own))


def fail_closed_repos(r: Any) -> dict[str, dict[str, str]]:
    """Every fail-closed repository -> its flag (reason, at_ms, detail); key "*": global."""
    out: dict[str, dict[str, str]] = {}
    glob = r.hgetall(FAIL_CLOSED)
    if glob:
        out["*"] = glob
    # retired ones too: a registry conflict may fail one closed (its purge then waits)
    repos = sorted(set(r.smembers(REPOS)) | set(r.hkeys(RETIRED)))
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
