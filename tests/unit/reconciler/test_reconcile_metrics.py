"""Reconciler metrics: the figures come from the run summary, and the Prometheus text carries the
same numbers; a metrics sink that is down never fails the run."""

from __future__ import annotations

from pathlib import Path

from core.settings import load_settings
from reconciler.metrics import figures, publish, registry_for
from sim.stack import free_port

SUMMARY = {
    "repository": "r", "run_id": "", "now_ms": 1_700_000_000_000, "success": True,
    "dry_run": False, "status": "done",
    "mark": {"listed": 10, "listed_bytes": 1000, "marked": 3, "marked_bytes": 30,
             "categories": {"leaked": {"count": 2, "bytes": 20},
                            "unreferenced": {"count": 1, "bytes": 10}}},
    "sweep": {"status": "done", "confirmed": 3, "confirmed_bytes": 30, "failed": 0,
              "refused": 0, "skipped_live": 0, "seconds": 1.5},
    "crosscheck": {"marked_but_referenced_online": {"count": 0, "sample": []},
                   "committed_missing_from_store": {"count": 1, "sample": ["k"]}},
    "timings": {"mark_s": 2.5},
}


def test_figures_and_text_agree() -> None:
    f = figures(SUMMARY)
    assert f["success"] == 1.0 and f["deleted_objects"] == 3 and f["listed_bytes"] == 1000
    assert f["category_objects"] == {"leaked": 2, "unreferenced": 1}
    assert f["crosscheck_divergences"]["committed_missing_from_store"] == 1
    from prometheus_client import generate_latest

    text = generate_latest(registry_for([{**SUMMARY, "metrics": f}])).decode()
    assert 'hardelete_reconcile_deleted_objects{repository="r"} 3.0' in text
    assert 'hardelete_reconcile_mark_seconds{repository="r"} 2.5' in text
    assert ('hardelete_reconcile_crosscheck_divergences{check="committed_missing_from_store",'
            'repository="r"} 1.0') in text
    failed = figures({**SUMMARY, "sweep": {"status": "failed"}})
    assert failed["success"] == 0.0
    # a sweep stopped part-way: what the store confirmed until then
    stopped = figures({**SUMMARY, "sweep": {**SUMMARY["sweep"], "status": "failed",
                                            "error": "lease lost", "confirmed": 2}})
    assert stopped["success"] == 0.0 and stopped["deleted_objects"] == 2
    dry = figures({**SUMMARY, "dry_run": True, "sweep": {"status": "not_run"}})
    assert dry["success"] == 1.0


def test_sinks_down_never_fail_the_run(tmp_path: Path) -> None:
    s = load_settings(env={}, metrics_textfile=str(tmp_path / "no/such/dir/x.prom"),
                      pushgateway_url=f"http://127.0.0.1:{free_port()}")
    summaries = [dict(SUMMARY)]
    publish(s, summaries)  # logs the two failures, raises nothing
    assert summaries[0]["metrics"]["deleted_objects"] == 3
    ok = load_settings(env={}, metrics_textfile=str(tmp_path / "run.prom"))
    publish(ok, [dict(SUMMARY)])
    assert 'hardelete_reconcile_success{repository="r"} 1.0' in (tmp_path / "run.prom").read_text()
