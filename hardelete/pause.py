"""``hardelete pause REPO --reason`` / ``hardelete resume REPO``: stop and restart deletion for one
repository. The paused key (``RepoKeys.paused``, json ``{reason, at_ms, claims}``) is read by the
reaper and the reconciler's sweep, which skip a paused repository; the tracker keeps applying
events, so nothing is lost while paused and resuming needs no catch-up.

A pause is a set of claims, one per operator (``user@host``, or ``--by``), as holds are: one
operator's ``resume`` lifts only that operator's pause, and the repository stays paused while
another's remains (``--force`` lifts them all). Changed by one script (``schemas/pause.py``), so
two operators at once never lose a claim. Each change is a durable fact of the repository
(``core/facts.py``), written to its namespace before Redis: a Redis that goes back forgets no
pause, because every delete path applies the facts it lacks before it deletes. A pause stored
before claims is lifted by any resume. (Found by an adversarial review: B's pause overwrote A's,
and A's resume lifted it.)"""

from __future__ import annotations

import argparse
from typing import Any

import orjson

from core.clock import redis_time_ms
from core.errors import UserError
from core.facts import PAUSE
from core.settings import Settings
from hardelete.holds import current, namespace_of, operator_s3, record, settle, when
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




def _pause_fact(r: Any, s3: Any, repo: str, op: str, by: str, reason: str = "",
                at: int = 0) -> None:
    """Change the pause as a durable fact (``core/facts.py``: the namespace first, then
    Redis, by the pause script)."""
    record(r, s3, repo, PAUSE, {"op": op, "who": by, "reason": reason, "at_ms": at},
           redis_time_ms(r))


def set_paused(r: Any, repo: str, reason: str, by: str | None = None, *, s3: Any) -> int:
    """Add ``by``'s pause claim (default: this operator, ``user@host``)."""
    from hardelete.failclosed import who

    namespace_of(r, repo)
    if not reason.strip():
        raise UserError("pausing needs a reason (--reason)")
    at = redis_time_ms(r)
    _pause_fact(r, s3, repo, "add", by or who(), reason, at)
    return at


def clear_paused(r: Any, repo: str, by: str | None = None, *, s3: Any, force: bool = False
                 ) -> tuple[dict[str, Any], dict[str, Any]]:
    """Remove ``by``'s pause claim (``force``: every claim); (the pause before, the claims
    that still pause the repository)."""
    from hardelete.failclosed import who

    current(r, s3, repo)
    info = paused_info(r, repo)
    if info is None:
        raise UserError(f"repository {repo!r} is not paused")
    _pause_fact(r, s3, repo, "force" if force else "remove", by or who())
    after = paused_info(r, repo)
    remaining = (after or {}).get("claims") or {}
    return info, remaining


def _redis(settings: Settings) -> Any:
    from core.clients import redis_sync

    return redis_sync(settings)


class pause:
    @staticmethod
    def configure(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("repository")
        parser.add_argument("--reason", required=True, help="why (shown by status)")
        parser.add_argument("--by", help="whose pause this is (default: user@host); `hardelete "
                                         "resume --by` the same name lifts it")

    @staticmethod
    def run_cli(settings: Settings, args: argparse.Namespace) -> int:
        r = _redis(settings)
        try:
            at = set_paused(r, args.repository, args.reason, args.by, s3=operator_s3(settings))
        finally:
            r.close()
        settle(settings)
        print(f"paused {args.repository} at {when(at)}: the reaper and the sweep delete nothing "
              "for it until `hardelete resume`; the tracker keeps tracking")
        return 0


class resume:
    @staticmethod
    def configure(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("repository")
        parser.add_argument("--by", help="whose pause to lift (default: user@host)")
        parser.add_argument("--force", action="store_true",
                            help="lift every operator's pause, not only yours")

    @staticmethod
    def run_cli(settings: Settings, args: argparse.Namespace) -> int:
        r = _redis(settings)
        try:
            info, remaining = clear_paused(r, args.repository, args.by, s3=operator_s3(settings),
                                           force=args.force)
        finally:
            r.close()
        if remaining:
            print(f"released your pause of {args.repository}; still paused by "
                  + ", ".join(f"{who} ({c.get('reason', '')})"
                              for who, c in sorted(remaining.items()))
                  + ": each resumes their own, or `hardelete resume --force`")
            return 0
        print(f"resumed {args.repository} (paused since {when(info.get('at_ms'))}: "
              f"{info.get('reason', '')})")
        return 0
