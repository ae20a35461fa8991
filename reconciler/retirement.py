"""Retirement keeps data until it is explicitly released (SPEC safety 8, issue 19 item 6).

A ``repository_deleted`` retires a repository: nothing of it is deleted online from then on,
and its namespace **stays registered to it** (``hd:namespaces``) while any of its data is kept,
so no new repository can be given that namespace and take the retired repository's committed
objects for leaks. The data is kept for ``retired_retention_days`` (default 7), then purged by
a reported run through the one deleter (``core.deleter``): every object of the namespace
outside the reserved metadata prefixes, each request re-judged right before it is sent (the
repository still retired and due, the namespace still registered to it, holds, pause,
fail-closed). Only when the store lists nothing left is the namespace freed (and the purge
recorded on the retirement record). An operator may release a repository before its
retention ends (``--release``): that too is recorded in the run's report.

``purge_due`` is the decision, pure; :func:`purge_retired` is the run.
"""

from __future__ import annotations

import argparse
import time
import uuid
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import orjson

from core.clients import redis_sync, s3_client, split_s3_uri
from core.clock import redis_time_ms
from core.deleter import S3_MAX_KEYS, Deleter, Plan
from core.errors import UserError
from core.facts import RepoFacts
from core.gate import Gate, read_gate
from core.logs import get_logger
from core.registry import free_namespace
from core.settings import Settings
from reconciler.report import iso
from reconciler.s3io import put_json
from schemas.layout import FAIL_CLOSED, NAMESPACES, RESERVED_PREFIXES, RETIRED, RepoKeys

log = get_logger("reconciler.retirement")

DAY_MS = 86_400_000


@dataclass(frozen=True, slots=True)
class Retired:
    """One retired repository (``hd:retired``)."""

    repository: str
    namespace: str
    at_ms: int
    purged_at_ms: int | None = None
    released_at_ms: int | None = None  # an operator released it before its retention ended

    def keep_until_ms(self, retention_days: float) -> int:
        return self.at_ms + int(retention_days * DAY_MS)

    def as_dict(self, retention_days: float) -> dict[str, Any]:
        return {"repository": self.repository, "namespace": self.namespace,
                "retired_at": iso(self.at_ms),
                "kept_until": iso(self.keep_until_ms(retention_days)),
                "released_at": iso(self.released_at_ms) if self.released_at_ms else None,
                "purged_at": iso(self.purged_at_ms) if self.purged_at_ms else None}


def parse_retired(repo: str, raw: str | bytes) -> Retired:
    d = orjson.loads(raw)
    return Retired(repo, str(d.get("namespace", "")), int(d.get("at_ms") or 0),
                   d.get("purged_at_ms"), d.get("released_at_ms"))


def retired_repositories(r: Any) -> list[Retired]:
    return [parse_retired(repo, raw) for repo, raw in sorted(r.hgetall(RETIRED).items())]


def purge_due(rec: Retired, now_ms: int, retention_days: float) -> str | None:
    """Why ``rec``'s data may not be purged now, or None (pure)."""
    if rec.purged_at_ms is not None:
        return "already purged"
    if not rec.namespace:
        return "the retirement record names no namespace"
    if rec.released_at_ms is None and now_ms < rec.keep_until_ms(retention_days):
        return (f"kept until {iso(rec.keep_until_ms(retention_days))} "
                f"(retired_retention_days {retention_days:g}); --release purges it earlier")
    return None


def guard_keeps(gate: Gate, repo: str, namespace: str, addresses: Iterable[str]
                ) -> dict[str, str]:
    """address -> reason the retired purge keeps it (pure): a repository's references no longer
    count once it is retired, but its pause, its holds and fail-closed still do."""
    keep = {}
    for address in addresses:
        guards = gate.guards(repo, namespace, address)
        reason = guards.paused or guards.held or guards.fail_closed
        if reason:
            keep[address] = reason
    return keep


def _record(r: Any, rec: Retired, **changes: Any) -> None:
    d = orjson.loads(r.hget(RETIRED, rec.repository) or b"{}")
    d.update(changes)
    r.hset(RETIRED, rec.repository, orjson.dumps(d).decode())


def _pages(s3: Any, bucket: str, prefix: str) -> Any:
    """The listing's pages; a bucket that does not exist holds nothing of it."""
    from botocore.exceptions import ClientError

    try:
        yield from s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
    except ClientError as exc:
        if exc.response.get("Error", {}).get("Code") != "NoSuchBucket":
            raise


REPORTS = "_hardelete/reports/"
PURGE_RUN = "retired-"


def durable_purge(s3: Any, bucket: str, prefix: str, repo: str) -> str | None:
    """The run id of a completed purge of ``repo`` whose report the namespace holds, or None.

    The report is the purge's durable record: a Redis that went back (restored from a copy
    taken before the purge) brings the retirement back unpurged and the namespace registered
    to it, while a next owner's live data may already lie there. A report anyone forged only
    stops a purge (the safe side): the purge that finds one deletes and frees nothing."""
    for page in _pages(s3, bucket, f"{prefix}{REPORTS}{PURGE_RUN}"):
        for obj in page.get("Contents", []):
            if not obj["Key"].endswith("/summary.json"):
                continue
            try:
                d = orjson.loads(s3.get_object(Bucket=bucket, Key=obj["Key"])["Body"].read())
            except orjson.JSONDecodeError:
                continue
            if isinstance(d, dict) and d.get("repository") == repo \
                    and d.get("kind") == "retired_purge" and d.get("status") == "done":
                return str(d.get("run_id") or obj["Key"])
    return None


def _code(exc: BaseException) -> str:
    return str(getattr(exc, "response", {}).get("Error", {}).get("Code", ""))


def purge_retired(settings: Settings, repo: str, *, release: bool = False,
                  progress: Any = None) -> dict[str, Any]:
    """Purge a retired repository's data once due (see the module docstring); the report."""
    r = redis_sync(settings)
    s3 = s3_client(settings)
    deleter = Deleter.for_settings(settings)
    try:
        raw = r.hget(RETIRED, repo)
        if raw is None:
            raise UserError(f"repository {repo!r} is not retired: nothing to purge")
        rec = parse_retired(repo, raw)
        now = redis_time_ms(r)
        if release and rec.released_at_ms is None and rec.purged_at_ms is None:
            _record(r, rec, released_at_ms=now)
            rec = parse_retired(repo, r.hget(RETIRED, repo))
        problem = purge_due(rec, now, settings.retired_retention_days)
        if problem is not None:
            raise UserError(f"{repo}: {problem}")
        ns = rec.namespace
        bucket, prefix = split_s3_uri(ns)
        earlier = durable_purge(s3, bucket, prefix, repo)
        if earlier is not None:
            # Redis went back past the purge (a next owner's data may lie there now), or the
            # report is forged (anyone who writes the namespace can): either way nothing is
            # deleted, and nothing is freed either (a freed namespace would let a next owner's
            # purge or sweep take what this one still keeps, held data included).
            raise UserError(f"{repo}: already purged by run {earlier}, says its report (in "
                            f"{ns}{REPORTS}): nothing was deleted and the namespace stays "
                            "registered to it; Redis went back past that purge, or the report "
                            "is forged: an operator who has judged it resolves it by hand")
        run_id = f"retired-{time.strftime('%Y%m%dT%H%M%S', time.gmtime(now / 1000))}-" \
                 f"{uuid.uuid4().hex[:6]}"
        summary: dict[str, Any] = {"run_id": run_id, "kind": "retired_purge",
                                   "repository": repo, "namespace": ns,
                                   "retired": rec.as_dict(settings.retired_retention_days),
                                   "started_at": iso(now), "deleted": 0, "kept": {},
                                   "failed": {}}

        def recheck(addresses: list[str]) -> dict[str, str]:
            # right before each request: still retired, due, still its namespace, no guard
            cur = r.hget(RETIRED, repo)
            why = None if cur is None else purge_due(parse_retired(repo, cur),
                                                     redis_time_ms(r),
                                                     settings.retired_retention_days)
            if cur is None:
                why = "no longer retired"
            elif r.hget(NAMESPACES, ns) != repo:
                why = f"namespace {ns} is no longer registered to {repo!r}"
            elif r.exists(FAIL_CLOSED):
                why = "all repositories fail-closed"
            if why is not None:
                return dict.fromkeys(addresses, why)
            proof = RepoFacts(r, deleter.client, repo, ns).prove(by="retired purge")
            return guard_keeps(read_gate(r, repo, addresses, facts=proof), repo, ns, addresses)

        listed = 0
        batch: list[str] = []

        def flush() -> None:
            res = deleter.delete(Plan(ns, recheck=recheck), batch)
            summary["deleted"] += len(res.deleted)
            summary["kept"].update(res.kept)
            summary["failed"].update(res.failed)
            summary["failed"].update(res.refused)
            batch.clear()
            if progress is not None:
                progress(summary["deleted"], listed)

        for page in _pages(s3, bucket, prefix):
            for obj in page.get("Contents", []):
                rel = obj["Key"][len(prefix):]
                if rel.startswith(RESERVED_PREFIXES):
                    continue  # its reports and manifests stay (and say what happened)
                listed += 1
                batch.append(f"s3://{bucket}/{obj['Key']}")
                if len(batch) >= S3_MAX_KEYS:
                    flush()
        if batch:
            flush()
        summary["listed"] = listed
        summary["finished_at"] = iso(redis_time_ms(r))
        left = not summary["kept"] and not summary["failed"]
        summary["status"] = "done" if left else "incomplete"
        try:
            # Written before the namespace is freed: the report is the purge's durable record.
            put_json(s3, bucket, f"{prefix}{REPORTS}{run_id}/summary.json", summary)
        except Exception as exc:  # (no bucket): the summary is still returned and logged
            summary["report_error"] = f"{type(exc).__name__}: {exc}"
            if left and _code(exc) != "NoSuchBucket":  # no durable record: not freed
                left, summary["status"] = False, "incomplete"
        if left:
            # Nothing of it is kept any more: the namespace may be given to a new repository.
            free_namespace(r, repo, ns)
            _record(r, rec, purged_at_ms=redis_time_ms(r), purge_run=run_id)
            r.delete(RepoKeys(repo).holds, RepoKeys(repo).hold_prefixes)
        log.info("retired repository purged" if left else "retired purge incomplete",
                 repository=repo, deleted=summary["deleted"], kept=len(summary["kept"]),
                 failed=len(summary["failed"]), run_id=run_id)
        return summary
    finally:
        r.close()


# ---------------------------------------------------------------------------------- CLI

class list_:
    @staticmethod
    def configure(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--json", action="store_true")

    @staticmethod
    def run_cli(settings: Settings, args: argparse.Namespace) -> int:
        r = redis_sync(settings)
        try:
            now = redis_time_ms(r)
            rows = []
            for rec in retired_repositories(r):
                why = purge_due(rec, now, settings.retired_retention_days)
                rows.append({**rec.as_dict(settings.retired_retention_days),
                             "purge": "due" if why is None else why})
        finally:
            r.close()
        if args.json:
            print(orjson.dumps(rows, option=orjson.OPT_INDENT_2).decode())
            return 0
        if not rows:
            print("no retired repositories")
        for row in rows:
            print(f"{row['repository']}  {row['namespace']}  retired {row['retired_at']}  "
                  f"kept until {row['kept_until']}  purge: {row['purge']}")
        return 0


class purge:
    @staticmethod
    def configure(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("repository")
        parser.add_argument("--release", action="store_true",
                            help="purge before the retention ends (recorded in the report)")
        parser.add_argument("--json", action="store_true")

    @staticmethod
    def run_cli(settings: Settings, args: argparse.Namespace) -> int:
        summary = purge_retired(settings, args.repository, release=args.release)
        if args.json:
            print(orjson.dumps(summary, option=orjson.OPT_INDENT_2).decode())
        else:
            print(f"{args.repository}: {summary['status']}: deleted {summary['deleted']} of "
                  f"{summary['listed']} objects under {summary['namespace']}, kept "
                  f"{len(summary['kept'])}, failed {len(summary['failed'])}; report "
                  f"{summary['run_id']}")
        return 0 if summary["status"] == "done" else 1
