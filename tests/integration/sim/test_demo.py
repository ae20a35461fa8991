"""The demo end to end: model service, tracker and reaper on the real stack; its table and its
JSON say the same, and nothing live is deleted."""

from __future__ import annotations

import io
import os
import subprocess
import sys
import uuid

import orjson
import pytest
from rich.console import Console

from core.settings import Settings
from sim.demo import DemoOptions, print_summary, run_demo, summary_json


@pytest.mark.slow
def test_demo_reaps_exactly_the_online_garbage_then_reconciles(settings: Settings) -> None:
    options = DemoOptions(seed=5, ops=80, run_id=uuid.uuid4().hex[:8], grace_seconds=1.0,
                          upload_ttl_seconds=1.0)
    result = run_demo(settings, options, Console(file=io.StringIO()))
    assert result.model.store.ok, result.model.store
    online = result.online
    assert not online.timed_out
    assert online.live_deleted == 0
    assert online.garbage_online > 0 and online.reaped == online.garbage_online
    assert online.reaper_records >= 1  # the reaper's deletes go into the log too
    # every event the service committed was applied, in order (its history is certified)
    assert online.events_committed == result.model.summary.events_published
    assert online.events_certified == online.events_committed > 0
    assert online.events_applied >= online.events_committed + online.reaper_records
    recon = result.reconcile
    assert recon is not None and all(run["success"] for run in recon.runs)
    assert recon.expected > 0 and recon.deleted == recon.expected
    assert recon.live_deleted == 0 and recon.garbage_left == 0
    assert result.ok
    body = orjson.loads(summary_json(result))
    assert body["ok"] is True and body["online"]["reaped"] == online.reaped
    out = io.StringIO()
    print_summary(result, Console(file=out, width=400))
    text = out.getvalue()
    assert "live objects deleted (must be 0)" in text
    assert "reaper deleted exactly the online garbage" in text
    assert "the reconciler deleted exactly the rest of the garbage" in text


def test_demo_cli_json_on_configured_servers(settings: Settings) -> None:
    env = {**os.environ,
           "HARDELETE_KAFKA_BOOTSTRAP": settings.kafka_bootstrap,
           "HARDELETE_REDIS_URL": settings.redis_url,
           "HARDELETE_S3_ENDPOINT_URL": settings.s3_endpoint_url,
           "HARDELETE_EVENTS_TOPIC": settings.events_topic,
           "HARDELETE_DLQ_TOPIC": settings.dlq_topic,
           "HARDELETE_CONSUMER_GROUP": settings.consumer_group,
           "HARDELETE_SESSION_TIMEOUT_MS": "3000", "HARDELETE_HEARTBEAT_INTERVAL_MS": "1000"}
    proc = subprocess.run(
        [sys.executable, "-m", "hardelete.cli", "demo", "--json", "--ops", "30", "--grace", "1",
         "--upload-ttl", "1", "--bucket", "cli-demo", "--no-reconcile"],
        env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-2000:]
    body = orjson.loads(proc.stdout)
    assert body["ok"] is True
    assert body["endpoints"]["started"] == []  # it used the configured servers
    assert body["online"]["live_deleted"] == 0
    assert body["reconcile"] is None


def test_demo_bad_option_is_one_line() -> None:
    proc = subprocess.run([sys.executable, "-m", "hardelete.cli", "demo", "--grace", "-1"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert "--grace" in proc.stderr and "Traceback" not in proc.stderr
