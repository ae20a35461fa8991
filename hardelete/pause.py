"""``hardelete pause REPO --reason`` / ``hardelete resume REPO``: stop and restart deletion for one
repository. The paused key (``RepoKeys.paused``, json ``{reason, at_ms}``) is read by the reaper
and the reconciler's sweep, which skip a paused repository; the tracker keeps applying events, so
nothing is lost while paused and resuming needs no catch-up."""

from __future__ import annotations

import argparse
from typing import Any

import orjson

from hardelete import UserError
from hardelete.holds import namespace_of, now_ms, when
from hardelete.settings import Settings
from schemas.layout import RepoKeys


def paused_info(r: Any, repo: str) -> dict[str, Any] | None:
    raw = r.get(RepoKeys(repo).paused)
    if raw is None:
        return None
    try:
        value = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return {"reason": str(raw)}
    return value if isinstance(value, dict) else {"reason": str(value)}


def set_paused(r: Any, repo: str, reason: str) -> int:
    namespace_of(r, repo)
    if not reason.strip():
        raise UserError("pausing needs a reason (--reason)")
    at = now_ms(r)
    r.set(RepoKeys(repo).paused, orjson.dumps({"reason": reason, "at_ms": at}).decode())
    return at


def clear_paused(r: Any, repo: str) -> dict[str, Any]:
    namespace_of(r, repo)
    info = paused_info(r, repo)
    if info is None:
        raise UserError(f"repository {repo!r} is not paused")
    r.delete(RepoKeys(repo).paused)
    return info


def _redis(settings: Settings) -> Any:
    from hardelete.clients import redis_sync

    return redis_sync(settings)


class pause:
    @staticmethod
    def configure(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("repository")
        parser.add_argument("--reason", required=True, help="why (shown by status)")

    @staticmethod
    def run_cli(settings: Settings, args: argparse.Namespace) -> int:
        r = _redis(settings)
        try:
            at = set_paused(r, args.repository, args.reason)
        finally:
            r.close()
        print(f"paused {args.repository} at {when(at)}: the reaper and the sweep delete nothing "
              "for it until `hardelete resume`; the tracker keeps tracking")
        return 0


class resume:
    @staticmethod
    def configure(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("repository")

    @staticmethod
    def run_cli(settings: Settings, args: argparse.Namespace) -> int:
        r = _redis(settings)
        try:
            info = clear_paused(r, args.repository)
        finally:
            r.close()
        print(f"resumed {args.repository} (paused since {when(info.get('at_ms'))}: "
              f"{info.get('reason', '')})")
        return 0
