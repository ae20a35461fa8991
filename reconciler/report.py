"""Run reports in the namespace: ``<ns>_hardelete/reports/<run_id>/`` (format in README.md)."""

from __future__ import annotations

import datetime as dt
import secrets
from collections.abc import Iterator
from typing import Any

from reconciler.s3io import Namespace, get_json, list_dirs, put_json
from schemas.layout import REPORTS_PREFIX

REPORT_FORMAT = 2  # 2: digests in the mark, retention fingerprint
SUMMARY = "summary.json"


def new_run_id(now_ms: int) -> str:
    """Sortable by time: ``20260101T020000Z-1a2b3c``."""
    stamp = dt.datetime.fromtimestamp(now_ms / 1000, dt.UTC).strftime("%Y%m%dT%H%M%SZ")
    return f"{stamp}-{secrets.token_hex(3)}"


def iso(ms: int | None) -> str | None:
    if ms is None:
        return None
    return dt.datetime.fromtimestamp(ms / 1000, dt.UTC).isoformat(timespec="milliseconds")


def summary_key(ns: Namespace, run_id: str) -> str:
    return ns.report_prefix(run_id) + SUMMARY


def write_summary(s3: Any, ns: Namespace, summary: dict[str, Any]) -> None:
    put_json(s3, ns.bucket, summary_key(ns, summary["run_id"]), summary)


def read_summary(s3: Any, ns: Namespace, run_id: str) -> dict[str, Any] | None:
    try:
        data = get_json(s3, ns.bucket, summary_key(ns, run_id))
    except s3.exceptions.NoSuchKey:
        return None
    except Exception as exc:  # botocore ClientError 404 on some servers
        if "NoSuchKey" in str(exc) or "404" in str(exc):
            return None
        raise
    return data if isinstance(data, dict) else None


def run_ids(s3: Any, ns: Namespace) -> list[str]:
    """Every run id with a report in the namespace, newest first."""
    prefix = ns.key(REPORTS_PREFIX)
    ids = [p[len(prefix):].rstrip("/") for p in list_dirs(s3, ns.bucket, prefix)]
    return sorted(ids, reverse=True)


def previous_runs(s3: Any, ns: Namespace, repo: str,
                  before: str | None = None) -> Iterator[dict[str, Any]]:
    """Summaries of this repository's earlier runs, newest first."""
    for rid in run_ids(s3, ns):
        if before is not None and rid >= before:
            continue
        summary = read_summary(s3, ns, rid)
        if summary and summary.get("repository") == repo:
            yield summary


def is_swept_baseline(summary: dict[str, Any]) -> bool:
    """A run an optimized run may start from: a successful mark whose sweep completed."""
    return bool(summary.get("success")) and (summary.get("sweep") or {}).get("status") == "done"
