"""``hardelete reports list|show``: past reconciler runs, from the summary.json each run writes in
its repository's namespace (``<ns>_hardelete/reports/<run_id>/summary.json``; format in
reconciler/README.md). The reports live beside the data, so they outlive Redis and the runner."""

from __future__ import annotations

import argparse
from typing import Any

import orjson

from core.errors import UserError
from core.settings import Settings
from hardelete.cli import non_negative
from hardelete.holds import namespace_of
from schemas.layout import REPOS


def _row(repo: str, s: dict[str, Any]) -> dict[str, Any]:
    mark = s.get("mark") or {}
    sweep = s.get("sweep") or {}
    return {
        "repository": repo, "run_id": s.get("run_id"), "started_at": s.get("started_at"),
        "mode": s.get("mode"), "dry_run": bool(s.get("dry_run")), "status": s.get("status"),
        "success": bool(s.get("success")), "listed": mark.get("listed"),
        "marked": mark.get("marked"), "sweep": sweep.get("status"),
        "confirmed": sweep.get("confirmed"), "confirmed_bytes": sweep.get("confirmed_bytes"),
        "failed": sweep.get("failed"), "error": s.get("error"),
    }


def run_rows(r: Any, s3: Any, repo: str | None, limit: int) -> list[dict[str, Any]]:
    from reconciler.report import read_summary, run_ids
    from reconciler.s3io import Namespace

    repos = [repo] if repo else sorted(r.smembers(REPOS))
    rows: list[dict[str, Any]] = []
    for repository in repos:
        ns = Namespace(namespace_of(r, repository))
        ids = _run_ids(s3, ns, run_ids)
        count = 0
        for rid in ids:
            summary = read_summary(s3, ns, rid)
            # namespaces are exclusive, yet a report names its repository: trust only that
            if summary is None or summary.get("repository") != repository:
                continue
            rows.append(_row(repository, summary))
            count += 1
            if limit and count >= limit:
                break
    return rows


def _run_ids(s3: Any, ns: Any, run_ids: Any) -> list[str]:
    from botocore.exceptions import ClientError

    try:
        return list(run_ids(s3, ns))
    except ClientError as exc:
        code = exc.response.get("Error", {}).get("Code", "")
        if code == "NoSuchBucket":
            return []  # no bucket, no report
        raise UserError(f"cannot list the reports in {ns.uri}: {code or exc}") from None


def find_summary(r: Any, s3: Any, run_id: str, repo: str | None) -> dict[str, Any]:
    from reconciler.report import read_summary
    from reconciler.s3io import Namespace

    repos = [repo] if repo else sorted(r.smembers(REPOS))
    for repository in repos:
        ns = Namespace(namespace_of(r, repository))
        summary = read_summary(s3, ns, run_id)
        if summary is not None and summary.get("repository") == repository:
            return summary
    where = f"repository {repo!r}" if repo else "any repository"
    raise UserError(f"no report of run {run_id!r} in {where} (see `hardelete reports list`)")


def _clients(settings: Settings) -> tuple[Any, Any]:
    from core.clients import redis_sync, s3_client

    return redis_sync(settings), s3_client(settings)


class list_:
    @staticmethod
    def configure(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--repo", help="one repository (default: every one)")
        parser.add_argument("--limit", type=non_negative, default=20,
                            help="newest N per repository (0: all)")
        parser.add_argument("--json", action="store_true")

    @staticmethod
    def run_cli(settings: Settings, args: argparse.Namespace) -> int:
        r, s3 = _clients(settings)
        try:
            rows = run_rows(r, s3, args.repo, args.limit)
        finally:
            r.close()
        if args.json:
            print(orjson.dumps(rows, option=orjson.OPT_INDENT_2).decode())
            return 0
        from rich.console import Console
        from rich.table import Table

        t = Table(title=f"reconciler runs ({len(rows)})")
        for col in ("repository", "run", "started", "mode", "status", "listed", "marked",
                    "sweep", "deleted", "failed"):
            t.add_column(col)
        for row in rows:
            status = row["status"] or "?"
            if row["dry_run"]:
                status += " (dry run)"
            style = "" if row["success"] else "red"
            t.add_row(row["repository"], row["run_id"], row["started_at"] or "-",
                      row["mode"] or "-", status, _n(row["listed"]), _n(row["marked"]),
                      row["sweep"] or "-", _n(row["confirmed"]), _n(row["failed"]), style=style)
        Console().print(t)
        return 0


def _n(v: Any) -> str:
    return "-" if v is None else f"{v:,}"


class show:
    @staticmethod
    def configure(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("run_id")
        parser.add_argument("--repo", help="repository (default: searched)")
        parser.add_argument("--json", action="store_true", help="the summary.json as stored")

    @staticmethod
    def run_cli(settings: Settings, args: argparse.Namespace) -> int:
        r, s3 = _clients(settings)
        try:
            summary = find_summary(r, s3, args.run_id, args.repo)
        finally:
            r.close()
        if args.json:
            print(orjson.dumps(summary, option=orjson.OPT_INDENT_2).decode())
            return 0
        from rich.console import Console

        from reconciler.ui import summary_table

        con = Console()
        con.print(summary_table(summary))
        con.print(f"started {summary.get('started_at')}, finished "
                  f"{summary.get('finished_at', '-')}, cutoff {summary.get('cutoff', '-')}")
        if summary.get("error"):
            con.print(f"[red]error: {summary['error']}[/red]")
        return 0
