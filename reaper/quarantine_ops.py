"""``hardelete quarantine list|purge``: what the reaper moved to quarantine (quarantine_days > 0)
and the removal of copies whose keep period is over. Purge only ever touches the quarantine prefix
of a namespace (reaper/quarantine.py ``purge_expired``); restoring is ``hardelete restore``."""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import time
from dataclasses import asdict, dataclass
from typing import Any

import orjson

from core.clients import redis_sync, s3_client, split_s3_uri
from core.deleter import Deleter
from core.errors import UserError
from core.registry import repo_namespace
from core.settings import Settings
from reaper.quarantine import purge_expired, purge_recheck
from schemas.layout import QUARANTINE_PREFIX, REPOS


@dataclass
class Quarantined:
    repository: str
    address: str  # where it came from (hardelete restore brings it back there)
    copy: str  # the quarantine copy
    size: int
    expires: float | None  # unix seconds; after it `quarantine purge` deletes the copy
    expired: bool


def _namespaces(r: Any, repo: str | None) -> list[tuple[str, str]]:
    repos = [repo] if repo else sorted(r.smembers(REPOS))
    out = []
    for repository in repos:
        ns = repo_namespace(r, repository)
        if not ns:
            raise UserError(f"unknown repository {repository!r} (the tracker has not seen it)")
        out.append((repository, str(ns)))
    return out


def _namespaces_of(settings: Settings, repo: str | None) -> list[tuple[str, str]]:
    r = redis_sync(settings)
    try:
        return _namespaces(r, repo)
    finally:
        r.close()


def list_quarantine(s3: Any, repo: str, namespace: str, now: float | None = None
                    ) -> list[Quarantined]:
    from botocore.exceptions import ClientError

    now = time.time() if now is None else now
    bucket, prefix = split_s3_uri(namespace + QUARANTINE_PREFIX)
    out = []
    try:
        for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
            for obj in page.get("Contents", []):
                meta = s3.head_object(Bucket=bucket, Key=obj["Key"]).get("Metadata", {})
                try:
                    expires: float | None = float(meta["hardelete-expires"])
                except (KeyError, ValueError):
                    expires = None  # never purged: keeping is the safe default
                original = meta.get("hardelete-address") or (
                    namespace + obj["Key"][len(prefix):])
                out.append(Quarantined(repo, original, f"s3://{bucket}/{obj['Key']}",
                                       int(obj.get("Size", 0)), expires,
                                       expires is not None and expires <= now))
    except ClientError as exc:
        if exc.response.get("Error", {}).get("Code") == "NoSuchBucket":
            return []
        raise
    return out


def _iso(t: float | None) -> str:
    if t is None:
        return "never"
    return dt.datetime.fromtimestamp(t, dt.UTC).isoformat(timespec="seconds")


class list_:
    @staticmethod
    def configure(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--repo", help="one repository (default: every one)")
        parser.add_argument("--json", action="store_true")

    @staticmethod
    def run_cli(settings: Settings, args: argparse.Namespace) -> int:
        spaces = _namespaces_of(settings, args.repo)
        s3 = s3_client(settings)
        items = [q for repo, ns in spaces for q in list_quarantine(s3, repo, ns)]
        if args.json:
            print(orjson.dumps([asdict(q) for q in items], option=orjson.OPT_INDENT_2).decode())
            return 0
        from rich.console import Console
        from rich.table import Table

        t = Table(title=f"quarantine ({len(items)} objects, "
                        f"{sum(q.size for q in items):,} bytes)")
        for col in ("repository", "address", "size", "purge after", "restore with"):
            t.add_column(col)
        for q in items:
            t.add_row(q.repository, q.address, f"{q.size:,}",
                      _iso(q.expires) + (" (expired)" if q.expired else ""),
                      f"hardelete restore {q.repository} {q.address}")
        Console().print(t)
        return 0


class purge:
    @staticmethod
    def configure(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--repo", help="one repository (default: every one)")
        parser.add_argument("--dry-run", action="store_true", help="only say what would go")

    @staticmethod
    def run_cli(settings: Settings, args: argparse.Namespace) -> int:
        spaces = _namespaces_of(settings, args.repo)
        s3 = s3_client(settings)
        total = 0
        for repo, ns in spaces:
            if args.dry_run:
                expired = [q for q in list_quarantine(s3, repo, ns) if q.expired]
                for q in expired:
                    print(f"would purge {q.copy} (from {q.address}, expired {_iso(q.expires)})")
                n = len(expired)
            else:
                r = redis_sync(settings)
                try:
                    # through the one deleter: each copy is judged (holds, pause, fail-closed, the
                    # address's record) right before its request
                    deleter = Deleter.for_settings(settings)
                    n = len(asyncio.run(purge_expired(
                        deleter, ns, listing=s3,
                        recheck=purge_recheck(r, deleter.client, repo, ns,
                                              int(settings.grace_for(repo) * 1000)))).deleted)
                finally:
                    r.close()
            total += n
            print(f"{repo}: {'would purge' if args.dry_run else 'purged'} {n} expired "
                  f"quarantine object(s) under {ns}{QUARANTINE_PREFIX}")
        return 0


def restore_hint(s3: Any, settings: Settings, repo: str, namespace: str,
                 address: str) -> list[str]:
    """For `explain` of a reaped address: the restore command when a quarantine copy exists."""
    from botocore.exceptions import ClientError

    from reaper.quarantine import quarantine_address

    command = f"hardelete restore {repo} {address}"
    if s3 is None:
        if settings.quarantine_days > 0:
            return [f"the reaper quarantines (quarantine_days={settings.quarantine_days:g}); "
                    f"if the copy is still there: {command}"]
        return []
    try:
        bucket, key = split_s3_uri(quarantine_address(namespace, address))
        meta = s3.head_object(Bucket=bucket, Key=key).get("Metadata", {})
    except (ClientError, ValueError):
        return []
    try:
        until = _iso(float(meta["hardelete-expires"]))
    except (KeyError, ValueError):
        until = "never purged"
    return [f"in quarantine (kept until {until}): restore with `{command}`"]
