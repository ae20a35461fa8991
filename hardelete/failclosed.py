"""``hardelete fail-closed list|clear``: the repositories whose mirror is not proven complete.

The tracker puts a repository fail-closed (``RepoKeys.fail_closed``), or all of them
(``FAIL_CLOSED``), when it cannot replay what Redis lacks: the log was reset or re-created,
retention removed records Redis never applied, or Redis lost everything while the log no longer
starts at 0. Nothing is deleted for them (reaper, reconciler) until an operator, having rebuilt
the state (e.g. a reconciler run), lifts the flag here. Each clear is recorded as an incident
(who, why, what the flag said).

A repository in a registry conflict that still stands (its namespace overlaps one the registry
holds for another repository, or another live repository's: schemas/README.md, "Registry
conflicts") is not cleared: the conflict is resolved first, by retiring one of them.
"""

from __future__ import annotations

import argparse
import getpass
import socket
from collections.abc import Callable
from typing import Any, TypeVar

import orjson

from core.clients import redis_sync
from core.clock import redis_time_ms
from core.errors import UserError
from core.guards import fail_closed_repos
from core.registry import conflicts_standing
from core.settings import Settings
from schemas.layout import APPLIED, FAIL_CLOSED, INCIDENTS, RepoKeys

T = TypeVar("T")


def who() -> str:
    try:
        user = getpass.getuser()
    except Exception:  # no user name (containers)
        user = "unknown"
    return f"{user}@{socket.gethostname()}"


def clear(r: Any, repo: str | None, *, reason: str, who: str) -> int:
    """Lift the flag of ``repo`` (None: every flag, the global one included). Returns how many
    flags were lifted; each is recorded as an incident."""
    flags = fail_closed_repos(r)
    # Redis Cluster: a repository whose node went back keeps a marker in hd:applied (another
    # slot) that keeps it fail-closed even when its own flag was lost with the node.
    marked = {str(k): str(v) for k, v in (r.hgetall(APPLIED) or {}).items()
              if '"regressed"' in str(v)}
    known = set(flags) | set(marked)
    targets = sorted(known) if repo is None else [repo] if repo in known else []
    standing = conflicts_standing(r, [t for t in targets if t != "*"])
    if standing:
        c = next(iter(standing.values()))
        raise UserError(
            f"{', '.join(sorted(standing))} cannot be cleared: {c.reason().split('; ')[0]}; "
            "nothing was cleared. Resolve it first: retire one of them (its service's "
            "repository_deleted), then clear the others (schemas/README.md, Registry conflicts)")
    now = redis_time_ms(r)
    for target in targets:
        record = orjson.dumps({"type": "fail_closed_cleared", "repository": target,
                               "address": "", "event_id": "", "ref_id": "", "at_ms": now,
                               "by": who, "reason": reason,
                               "was": flags.get(target) or marked.get(target)})
        pipe = r.pipeline(transaction=False)
        if target == "*":
            pipe.delete(FAIL_CLOSED)
            pipe.rpush(INCIDENTS, record)
        else:
            pipe.delete(RepoKeys(target).fail_closed)
            pipe.rpush(RepoKeys(target).incidents, record)
            if target in marked:
                pipe.hdel(APPLIED, target)
        pipe.execute()
    return len(targets)


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("action", choices=["list", "clear"])
    parser.add_argument("repository", nargs="?", help="repository to clear")
    parser.add_argument("--all", action="store_true",
                        help="clear every flag, the global one included")
    parser.add_argument("--reason", default="",
                        help="why it is safe now (recorded with who cleared it)")
    parser.add_argument("--json", action="store_true", help="list as JSON")


def run_cli(settings: Settings, args: argparse.Namespace) -> int:
    if not settings.redis_url:
        raise UserError("fail-closed needs redis_url (HARDELETE_REDIS_URL)")
    r = redis_sync(settings)
    try:
        if args.action == "list":
            flags = fail_closed_repos(r)
            if args.json:
                print(orjson.dumps(flags, option=orjson.OPT_INDENT_2).decode())
            elif not flags:
                print("no repository is fail-closed")
            else:
                for repo, flag in sorted(flags.items()):
                    name = "(all repositories)" if repo == "*" else repo
                    print(f"{name:24} {flag.get('reason', '')}")
            return 0
        if bool(args.repository) == bool(args.all):
            raise UserError("clear needs a REPOSITORY or --all (not both)")
        n = clear(r, None if args.all else args.repository,
                  reason=args.reason or "(no reason given)", who=who())
        if n == 0:
            print("nothing to clear" + (f": {args.repository} is not fail-closed"
                                        if args.repository else ""))
            return 1
        print(f"cleared {n} fail-closed flag(s)")
        return 0
    finally:
        r.close()


# --- `hardelete rebuild prepare|apply` (tracker/rebuild.py) ------------------------------------


class prepare_:  # a CLI command (module:attr in hardelete.cli)
    """Snapshot the mirror of a fail-closed repository and print the nonce its service's
    state export must carry."""

    @staticmethod
    def configure(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("repository")
        parser.add_argument("--json", action="store_true")

    @staticmethod
    def run_cli(settings: Settings, args: argparse.Namespace) -> int:
        from tracker.rebuild import prepare

        p = _rebuilding(settings, lambda r, s3: prepare(r, s3, args.repository))
        if args.json:
            print(orjson.dumps(p.as_dict(), option=orjson.OPT_INDENT_2).decode())
        else:
            print(f"{p.repository}: snapshot of {p.refs} live reference(s) taken; have the "
                  f"service export its whole state with rebuild_nonce {p.nonce}, then run "
                  f"`hardelete rebuild apply {p.repository} --export LOCATION`")
        return 0


class apply_:
    """Rebuild a fail-closed repository's mirror from its service's state export and lift
    the flag (recorded as a `rebuilt` incident)."""

    @staticmethod
    def configure(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("repository")
        parser.add_argument("--export", required=True,
                            help="the state export: an s3:// or local folder holding "
                                 "state.json (format 2, schemas/README.md), or that file")
        parser.add_argument("--json", action="store_true")

    @staticmethod
    def run_cli(settings: Settings, args: argparse.Namespace) -> int:
        from tracker.rebuild import rebuild

        max_age_ms = int(settings.uncommitted_export_max_age_seconds * 1000)
        report = _rebuilding(settings, lambda r, s3: rebuild(
            r, s3, args.repository, args.export, max_age_ms=max_age_ms, by=who()))
        if args.json:
            print(orjson.dumps(report.as_dict(), option=orjson.OPT_INDENT_2).decode())
        else:
            c = report.counts
            print(f"{report.repository}: rebuilt from {report.export} and no longer "
                  f"fail-closed: {c['refs_removed']} reference(s) proven removed, "
                  f"{c['tokens_dropped']} token(s) dropped, {c['refs_added']} reference(s) "
                  f"and {c['commits_added']} commit(s) added, {c['addresses_committed']} "
                  f"address(es) committed by those commits, {report.incidents} incident(s)")
        return 0


def _rebuilding(settings: Settings, step: Callable[[Any, Any], T]) -> T:
    """One rebuild step with Redis and S3; what refuses it is a user's error, one line."""
    from core.clients import s3_client
    from tracker.rebuild import RebuildError

    if not settings.redis_url:
        raise UserError("rebuild needs redis_url (HARDELETE_REDIS_URL)")
    r = redis_sync(settings)
    try:
        return step(r, s3_client(settings))
    except RebuildError as exc:
        raise UserError(str(exc)) from None
    finally:
        r.close()
