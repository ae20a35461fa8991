"""Reconciler metrics in the Prometheus text format.

The reconciler is a batch job: nothing scrapes it while it runs. At the end of ``hardelete
reconcile`` its figures go (1) to a textfile for node-exporter's textfile collector
(``metrics_textfile``, written atomically), (2) to a Pushgateway (``pushgateway_url``), and
(3) into each run's summary (``summary["metrics"]``, also stored in summary.json), the same
numbers in all three. A metrics failure is logged and never changes what the run did or its exit
code.
"""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Gauge, push_to_gateway, write_to_textfile

from core.logs import get_logger
from core.settings import Settings

log = get_logger("reconciler.metrics")
JOB = "hardelete_reconciler"
P = "hardelete_reconcile_"

# name -> (help, path in the summary); labels: repository (and category / check)
SCALARS: dict[str, tuple[str, tuple[str, ...]]] = {
    "listed_objects": ("objects listed in the namespace", ("mark", "listed")),
    "listed_bytes": ("bytes listed in the namespace", ("mark", "listed_bytes")),
    "marked_objects": ("objects marked for deletion", ("mark", "marked")),
    "marked_bytes": ("bytes marked for deletion", ("mark", "marked_bytes")),
    "deleted_objects": ("deletes the store confirmed", ("sweep", "confirmed")),
    "deleted_bytes": ("bytes of confirmed deletes", ("sweep", "confirmed_bytes")),
    "delete_failures": ("deletes that failed", ("sweep", "failed")),
    "delete_refused": ("deletes refused by a guard", ("sweep", "refused")),
    "skipped_live": ("marked keys found live at the sweep's re-check", ("sweep", "skipped_live")),
    "mark_seconds": ("duration of the mark", ("timings", "mark_s")),
    "sweep_seconds": ("duration of the sweep", ("sweep", "seconds")),
}


def _get(summary: dict[str, Any], path: tuple[str, ...]) -> float | None:
    v: Any = summary
    for p in path:
        if not isinstance(v, dict):
            return None
        v = v.get(p)
    return float(v) if isinstance(v, int | float) and not isinstance(v, bool) else None


def figures(summary: dict[str, Any]) -> dict[str, Any]:
    """The metrics of one run, as stored in its summary (flat, labels folded into names)."""
    out: dict[str, Any] = {
        "success": 1.0 if _ok(summary) else 0.0,
        "run_timestamp_seconds": float(summary.get("now_ms") or 0) / 1000,
    }
    for name, (_help, path) in SCALARS.items():
        v = _get(summary, path)
        if v is not None:
            out[name] = v
    cats = ((summary.get("mark") or {}).get("categories") or {})
    out["category_objects"] = {c: float(v.get("count", 0)) for c, v in cats.items()}
    out["category_bytes"] = {c: float(v.get("bytes", 0)) for c, v in cats.items()}
    cross = summary.get("crosscheck") or {}
    out["crosscheck_divergences"] = {k: float(v["count"]) for k, v in cross.items()
                                     if isinstance(v, dict) and isinstance(v.get("count"), int)}
    return out


def _ok(summary: dict[str, Any]) -> bool:
    sweep = (summary.get("sweep") or {}).get("status")
    wanted = ("not_run",) if summary.get("dry_run") else ("done",)
    return bool(summary.get("success")) and sweep in wanted


def registry_for(summaries: list[dict[str, Any]]) -> CollectorRegistry:
    reg = CollectorRegistry()
    success = Gauge(P + "success", "1 if the last run succeeded (mark and sweep)",
                    ["repository"], registry=reg)
    stamp = Gauge(P + "run_timestamp_seconds", "when the last run started (Redis clock)",
                  ["repository"], registry=reg)
    scalars = {n: Gauge(P + n, h, ["repository"], registry=reg)
               for n, (h, _path) in SCALARS.items()}
    cat_n = Gauge(P + "category_objects", "objects per mark category",
                  ["repository", "category"], registry=reg)
    cat_b = Gauge(P + "category_bytes", "bytes per mark category",
                  ["repository", "category"], registry=reg)
    cross = Gauge(P + "crosscheck_divergences", "online state vs the mark, per check",
                  ["repository", "check"], registry=reg)
    for s in summaries:
        repo = str(s.get("repository"))
        f = s.get("metrics") or figures(s)
        success.labels(repo).set(f["success"])
        stamp.labels(repo).set(f["run_timestamp_seconds"])
        for n in SCALARS:
            if n in f:
                scalars[n].labels(repo).set(f[n])
        for c, v in f["category_objects"].items():
            cat_n.labels(repo, c).set(v)
        for c, v in f["category_bytes"].items():
            cat_b.labels(repo, c).set(v)
        for k, v in f["crosscheck_divergences"].items():
            cross.labels(repo, k).set(v)
    return reg


def _store(settings: Settings, summary: dict[str, Any]) -> None:
    """Put the figures into the stored summary.json too (the run itself wrote it without)."""
    if not summary.get("namespace") or not summary.get("run_id"):
        return
    from core.clients import s3_client
    from reconciler.report import write_summary
    from reconciler.s3io import Namespace

    write_summary(s3_client(settings), Namespace(summary["namespace"]), summary)


def publish(settings: Settings, summaries: list[dict[str, Any]]) -> None:
    """Add the figures to each summary, then write the textfile and push, as configured."""
    for s in summaries:
        s["metrics"] = figures(s)
        try:
            _store(settings, s)
        except Exception as exc:
            log.warning("reconcile.metrics_not_in_summary", run_id=s.get("run_id"),
                        error=str(exc))
    if not summaries or not (settings.metrics_textfile or settings.pushgateway_url):
        return
    reg = registry_for(summaries)
    if settings.metrics_textfile:
        try:
            write_to_textfile(settings.metrics_textfile, reg)
        except OSError as exc:
            log.error("reconcile.metrics_textfile_failed", path=settings.metrics_textfile,
                      error=str(exc))
    if settings.pushgateway_url:
        try:
            push_to_gateway(settings.pushgateway_url, job=JOB, registry=reg, timeout=5)
        except OSError as exc:
            log.error("reconcile.pushgateway_failed", url=settings.pushgateway_url,
                      error=str(exc))
