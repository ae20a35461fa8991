"""``hardelete incidents list|ack``: the incidents a person has not looked at yet.

Incidents are kept for ever, newest last: per repository (``hd:{R}:incidents``: a reference to
an address being reaped or reaped, a contradiction, a repository fail-closed ...) and of no live
repository (``hd:incidents``: a refused ``repository_created``, a registry conflict, every
repository fail-closed). ``status`` counts as needing a person each one after the count a person
acknowledged (``hd:incidents:acked``), except the records of what a person or the tracker's
rebuild already did about one (a fail-closed flag cleared, a repository rebuilt).
"""

from __future__ import annotations

import argparse
from dataclasses import asdict, dataclass
from typing import Any

import orjson

from core.clock import redis_time_ms
from core.errors import UserError
from core.settings import Settings
from schemas.layout import INCIDENTS, INCIDENTS_ACKED, REPOS, RepoKeys

GLOBAL = "*"
# What a person (fail-closed clear) or the tracker's rebuild did: recorded, nothing to do.
RECORDS_ONLY = frozenset({"fail_closed_cleared", "rebuilt"})


@dataclass(frozen=True)
class Incident:
    scope: str  # a repository id, or "*" (no live repository)
    index: int  # its place in the scope's list (the acknowledged count moves past it)
    kind: str
    at_ms: int | None
    body: dict[str, Any]

    @property
    def needs_person(self) -> bool:
        return self.kind not in RECORDS_ONLY

    def line(self) -> str:
        b = self.body
        what = b.get("address") or b.get("namespace") or b.get("reason") or ""
        return f"{self.scope} #{self.index} {self.kind}: {str(what)[:200]}"


def _key(scope: str) -> str:
    return INCIDENTS if scope == GLOBAL else RepoKeys(scope).incidents


def kind_of(body: dict[str, Any]) -> str:
    return str(body.get("type") or body.get("kind") or "incident")


def acked_counts(r: Any) -> dict[str, int]:
    out = {}
    for scope, raw in r.hgetall(INCIDENTS_ACKED).items():
        try:
            out[scope] = int(orjson.loads(raw)["count"])
        except (orjson.JSONDecodeError, KeyError, TypeError, ValueError):
            continue  # unreadable: nothing counts as acknowledged
    return out


def _decode(raw: Any) -> dict[str, Any]:
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return {"reason": str(raw)[:200]}
    return body if isinstance(body, dict) else {"reason": str(body)[:200]}


def scopes(r: Any) -> list[str]:
    return [GLOBAL, *sorted(r.smembers(REPOS))]


def unacknowledged(r: Any, among: list[str] | None = None) -> list[Incident]:
    """Every incident after its scope's acknowledged count, oldest first per scope."""
    acked = acked_counts(r)
    found = []
    for scope in among if among is not None else scopes(r):
        start = acked.get(scope, 0)
        for i, raw in enumerate(r.lrange(_key(scope), start, -1), start):
            body = _decode(raw)
            at = body.get("at_ms")
            found.append(Incident(scope, i, kind_of(body), at if isinstance(at, int) else None,
                                  body))
    return found


def acknowledge(r: Any, among: list[str], by: str, reason: str) -> dict[str, int]:
    """Acknowledge every incident each scope holds now; scope -> how many were new."""
    acked = acked_counts(r)
    now = redis_time_ms(r)
    done = {}
    for scope in among:
        count = int(r.llen(_key(scope)))
        if count > acked.get(scope, 0):
            r.hset(INCIDENTS_ACKED, scope, orjson.dumps(
                {"count": count, "by": by, "reason": reason, "at_ms": now}))
            done[scope] = count - acked.get(scope, 0)
    return done


def _among(r: Any, repo: str | None) -> list[str]:
    if repo is None:
        return scopes(r)
    if repo != GLOBAL and not r.sismember(REPOS, repo):
        raise UserError(f"unknown repository {repo!r} (`*`: the incidents of no live "
                        "repository)")
    return [repo]


class list_:
    @staticmethod
    def configure(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--repo", help="one repository ('*': of no live repository)")
        parser.add_argument("--json", action="store_true")

    @staticmethod
    def run_cli(settings: Settings, args: argparse.Namespace) -> int:
        from core.clients import redis_sync

        r = redis_sync(settings)
        try:
            found = unacknowledged(r, _among(r, args.repo))
        finally:
            r.close()
        if args.json:
            print(orjson.dumps([{**asdict(i), "needs_person": i.needs_person} for i in found],
                               option=orjson.OPT_INDENT_2).decode())
            return 0
        if not found:
            print("no incident since the last acknowledgement")
        for inc in found:
            print(("" if inc.needs_person else "(record) ") + inc.line())
        return 0


class ack:
    @staticmethod
    def configure(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--repo", help="one repository ('*': of no live repository; "
                                           "default: all)")
        parser.add_argument("--by", required=True, help="who looked at them")
        parser.add_argument("--reason", required=True, help="what was found or done")

    @staticmethod
    def run_cli(settings: Settings, args: argparse.Namespace) -> int:
        from core.clients import redis_sync

        if not args.by.strip() or not args.reason.strip():
            raise UserError("--by and --reason must not be empty")
        r = redis_sync(settings)
        try:
            done = acknowledge(r, _among(r, args.repo), args.by, args.reason)
        finally:
            r.close()
        if not done:
            print("nothing to acknowledge")
        for scope, n in done.items():
            print(f"acknowledged {n} incident(s) of {scope}")
        return 0
